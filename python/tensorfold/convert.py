"""Hugging Face checkpoint directory → GGUF (``tensorfold convert``).

Reads ``config.json``, the ``*.safetensors`` weights (one file, or shards listed in
``model.safetensors.index.json``), ``tokenizer.json`` / ``tokenizer_config.json`` (and the
optional ``generation_config.json`` / ``chat_template.jinja``) and writes one GGUF file that
TensorFold and llama.cpp both load: llama.cpp's metadata keys, tensor names and layouts.

Supported ``architectures[0]`` → ``general.architecture``:

    LlamaForCausalLM    → llama       Qwen2ForCausalLM    → qwen2
    MixtralForCausalLM  → llama       Qwen3ForCausalLM    → qwen3
                                      Qwen2MoeForCausalLM → qwen2moe
                                      Qwen3MoeForCausalLM → qwen3moe
    DeepseekV2ForCausalLM → deepseek2 DeepseekV3ForCausalLM → deepseek2
    DeepseekV4ForCausalLM → deepseek4 (tensorfold.convert_deepseek4: transformers' layouts and
                                       DeepSeek's FP8/FP4 release with its MTP layers)

Memory stays bounded: the converter first plans every output tensor from the safetensors
headers alone, writes the GGUF header, key/values and tensor table, then streams the tensor
data one output tensor at a time (a stacked expert tensor holds one layer's experts of one
projection). Source files are memory-mapped, never loaded whole.

Layouts (facts of the GGUF convention):
- arch ``llama`` uses llama.cpp's NORM rope, which rotates adjacent pairs (x[2i], x[2i+1]),
  while Hugging Face checkpoints rotate halves (x[i], x[i + d/2]). The rows of the Q and K
  projections are therefore reordered per head so that GGUF row 2i+j holds HF row j*d/2+i.
  The qwen families use NEOX rope (halves), so their weights are copied unchanged.
- routed experts are stacked per layer into one 3-D tensor per projection, numpy shape
  ``[n_expert, rows, cols]`` (GGUF ne = cols, rows, n_expert).
- ``deepseek2`` (DeepSeek V2/V3, multi-head latent attention) is written in llama.cpp's MLA
  form: ``kv_b_proj`` ([n_head*(nope+v), kv_lora]) is split per head into ``attn_k_b``, numpy
  ``[n_head, kv_lora, nope]`` (each head's K part transposed; GGUF ne = nope, kv_lora, n_head),
  and ``attn_v_b``, numpy ``[n_head, v, kv_lora]`` (GGUF ne = kv_lora, v, n_head);
  ``attention.head_count_kv`` is 1 (the latent is one shared "KV head"), key/value_length
  describe the latent (kv_lora + rope, kv_lora), the ``*_mla`` keys the per-head sizes. Its rope
  is llama.cpp's NORM (adjacent pairs), which is what DeepSeek checkpoints use
  (``rope_interleave`` true, the V3 default, and always for V2); with ``rope_interleave: false``
  HF rotates halves, so the rope rows of q/q_b (per head) and of kv_a are reordered like llama's
  Q/K above. The MoE layers' router becomes ``ffn_gate_inp``, V3's ``e_score_correction_bias``
  ``exp_probs_b.bias``, the shared experts ``ffn_*_shexp``; the first
  ``first_k_dense_replace`` layers are dense. Multi-token-prediction layers (layer index >=
  num_hidden_layers) are skipped, as llama.cpp does.

Tokenizer pre-type (``tokenizer.ggml.pre``): the name of the regex splits llama.cpp (and
TensorFold's tokenizer) apply before BPE. It is recognised from ``tokenizer.json``'s
``pre_tokenizer`` exactly, never guessed, because a wrong one silently splits text differently
(``pre=default`` cuts "I'm" apart where the source tokenizer keeps "'m"):
1. Split(llama-3's regex, Isolated) + ByteLevel(no regex)            → ``llama-bpe``
2. Split(Qwen2's regex, Isolated) + ByteLevel(no regex)              → ``qwen2``
3. Digits(individual_digits) + ByteLevel(GPT-2 regex)                → ``smollm``
4. ByteLevel(GPT-2 regex) alone                                      → ``gpt-2``
Anything else is refused with a ConvertError that says so; ``pre=`` / ``--pre NAME`` names the
pre-tokenizer explicitly (any name TensorFold's tokenizer knows).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

log = logging.getLogger("tensorfold.convert")

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "DeepseekV4ForCausalLM": "deepseek4",
}
OUTTYPES = ("f32", "f16", "bf16", "q8_0")

# GGML type ids (gguf.GGMLQuantizationType) and llama file types (gguf.LlamaFileType), kept
# here as plain numbers so the module imports without the gguf package.
_GGML_F32, _GGML_F16, _GGML_Q8_0, _GGML_I32, _GGML_BF16 = 0, 1, 8, 26, 30
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
_TYPE_NAME = {_GGML_F32: "F32", _GGML_F16: "F16", _GGML_Q8_0: "Q8_0", _GGML_BF16: "BF16"}

# token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


class ConvertError(ValueError):
    """The input directory cannot be converted; the message says why and what to do."""


# --------------------------------------------------------------------------------------
# safetensors access


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": None}


class _Source:
    """Name → file index over the checkpoint's safetensors files, with lazy, mmapped reads."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.files = _shard_paths(hf_dir)
        self.file_of: dict[str, int] = {}
        self.shape: dict[str, tuple[int, ...]] = {}
        self.dtype: dict[str, str] = {}
        self._handles: dict[int, Any] = {}
        self._headers: dict[int, tuple[int, dict]] = {}
        for i in range(len(self.files)):
            h = self._handle(i)
            for name in h.keys():
                if name in self.file_of:
                    raise ConvertError(f"tensor {name} appears in two shards")
                sl = h.get_slice(name)
                self.file_of[name] = i
                self.shape[name] = tuple(int(d) for d in sl.get_shape())
                self.dtype[name] = str(sl.get_dtype())

    def _handle(self, i: int):
        h = self._handles.get(i)
        if h is None:
            try:
                h = self._safe_open(self.files[i], framework="numpy")
            except Exception as e:  # corrupt header, not a safetensors file, …
                raise ConvertError(f"{self.files[i]}: cannot read safetensors file: {e}") from e
            self._handles[i] = h
        return h

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def names(self) -> Iterable[str]:
        return self.file_of.keys()

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 (a fresh array; the file stays mapped, not loaded)."""
        if name not in self.file_of:
            raise ConvertError(f"tensor {name} is missing from the checkpoint")
        dt = self.dtype[name]
        if dt not in _ST_DTYPES:
            raise ConvertError(f"tensor {name} has dtype {dt}; only F32/F16/BF16/F64 checkpoints are supported")
        i = self.file_of[name]
        if dt == "BF16":
            return self._read_bf16(i, name)
        return np.asarray(self._handle(i).get_tensor(name), dtype=np.float32)

    def _read_bf16(self, i: int, name: str) -> np.ndarray:
        # numpy has no bfloat16: read the raw 16-bit words through the file's own header and
        # widen them (bf16 is the top half of an f32).
        path = self.files[i]
        if i not in self._headers:
            self._headers[i] = _safetensors_header(path)
        data_start, header = self._headers[i]
        info = header[name]
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - start != 2 * n:
            raise ConvertError(f"{path}: tensor {name} has inconsistent data offsets")
        words = np.memmap(path, dtype="<u2", mode="r", offset=data_start + start, shape=(n,))
        out = _bf16_to_f32(words).reshape(shape)
        del words
        return out

    def close(self) -> None:
        self._handles.clear()


def _shard_paths(hf_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the shards model.safetensors.index.json lists, else
    every *.safetensors file in hf_dir; ConvertError when there is none or a listed one is
    missing."""
    index_path = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index_path}: no 'weight_map' in the index")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
        if not files:
            if any(n.endswith((".bin", ".pt", ".pth")) for n in os.listdir(hf_dir)):
                raise ConvertError(
                    f"{hf_dir}: only PyTorch pickle weights (*.bin) found; re-save the model with "
                    "save_pretrained(..., safe_serialization=True) to get *.safetensors")
            raise ConvertError(f"{hf_dir}: no *.safetensors weights found")
    paths = [os.path.join(hf_dir, n) for n in files]
    for path in paths:
        if not os.path.isfile(path):
            raise ConvertError(f"shard {path} listed in the index is missing")
    return paths


def _safetensors_header(path: str) -> tuple[int, dict]:
    """(file offset of the tensor data, the JSON header) of a safetensors file; the header's
    data_offsets count from that offset."""
    try:
        with open(path, "rb") as f:
            (hlen,) = np.frombuffer(f.read(8), dtype="<u8")
            header = json.loads(f.read(int(hlen)))
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot read safetensors header: {e}") from e
    return 8 + int(hlen), header


def _bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) as float32: a bf16 value is the top half of an f32."""
    return (words.astype(np.uint32) << 16).view(np.float32)


# --------------------------------------------------------------------------------------
# hyper-parameters


def _read_json(path: str, what: str, required: bool = True) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise ConvertError(f"{what} not found: {path}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{path}: cannot parse {what}: {e}") from e
    if not isinstance(d, dict):
        raise ConvertError(f"{path}: {what} is not a JSON object")
    return d


@dataclass
class _Params:
    hf_arch: str
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx: int
    rms_eps: float
    rope_base: float
    rope_scaling: list | None  # GGUF (key suffix, type, value) rows after "rope.scaling."
    tied: bool | None  # None: decide from the weights
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    norm_topk: bool = False
    attn_bias: bool = False
    sliding_window: int = 0  # layers with a window attend to their last N positions (0: none)
    window_layers: list | None = None  # which layers have it (None: all)
    mla: _Mla | None = None  # deepseek2 only
    keep_mtp: bool = True  # deepseek2: keep the multi-token-prediction layers (nextn)

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0


@dataclass
class _Mla:
    """DeepSeek V2/V3 (deepseek2) hyper-parameters beyond _Params'."""
    q_lora_rank: int            # 0: no q-LoRA (plain q_proj)
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    n_dense_lead: int           # first_k_dense_replace
    n_expert_shared: int
    weights_scale: float        # routed_scaling_factor
    gating: int                 # gguf.ExpertGatingFuncType: 1 softmax, 2 sigmoid
    groups: tuple[int, int] | None  # (expert_group_count, expert_group_used_count) to write
    yarn_log_mul: float | None  # rope.scaling.yarn_log_multiplier as llama.cpp writes it (0.1 * mscale_all_dim)
    rope_interleave: bool       # False: HF rotates halves → reorder the rope rows
    n_nextn: int = 0            # multi-token-prediction layers the checkpoint carries (kept, as blk.N+j)


def _int(cfg: dict, key: str, *alts: str, default: int | None = None) -> int:
    for k in (key, *alts):
        v = cfg.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConvertError(f"config.json: {k} = {v!r} is not a positive integer")
            return v
    if default is None:
        raise ConvertError(f"config.json: required field '{key}' is missing")
    return default


def _rope(cfg: dict) -> tuple[float, list | None]:
    """rope base and scaling from either the transformers-4 keys (rope_theta, rope_scaling)
    or the transformers-5 rope_parameters dict; the scaling as llama.cpp's rope.scaling.* keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params
    else:
        base = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
    if not isinstance(base, (int, float)) or base <= 0:
        raise ConvertError(f"config.json: rope_theta = {base!r} is invalid")
    if not scaling:
        return float(base), None
    if not isinstance(scaling, dict):
        raise ConvertError(f"config.json: rope scaling {scaling!r} is not understood")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default", "none"):
        return float(base), None
    factor = scaling.get("factor")
    if kind in ("linear", "yarn"):
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ConvertError(f"config.json: {kind} rope scaling needs a positive factor, got {factor!r}")
    if kind == "linear":
        if factor == 1:
            return float(base), None
        return float(base), [("type", "str", "linear"), ("factor", "f32", float(factor))]
    if kind == "yarn":
        orig = scaling.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ConvertError("config.json: yarn rope scaling needs original_max_position_embeddings "
                               f"(a positive integer), got {orig!r}")
        if scaling.get("truncate", True) is False:
            raise ConvertError("config.json: yarn rope scaling with truncate=false cannot be represented by "
                               "TensorFold yet (llama.cpp's ramp rounds the correction range)")
        rows = [("type", "str", "yarn"), ("factor", "f32", float(factor)),
                ("original_context_length", "u32", orig)]
        for hf_key, gguf_key, default in (("beta_fast", "yarn_beta_fast", 32.0), ("beta_slow", "yarn_beta_slow", 1.0)):
            v = scaling.get(hf_key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConvertError(f"config.json: yarn {hf_key} = {v!r} is invalid")
            rows.append((gguf_key, "f32", float(v)))
        attn = scaling.get("attention_factor")
        if attn is not None:
            # transformers uses an explicit attention_factor instead of 0.1 ln(factor) + 1;
            # llama.cpp multiplies that default by yarn_attn_factor.
            if isinstance(attn, bool) or not isinstance(attn, (int, float)) or attn <= 0:
                raise ConvertError(f"config.json: yarn attention_factor = {attn!r} is invalid")
            default = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
            rows.append(("yarn_attn_factor", "f32", float(attn) / default))
        return float(base), rows
    raise ConvertError(
        f"config.json: rope scaling type '{kind}' cannot be represented by TensorFold yet "
        "(supported: none, linear, yarn)")


def _params(cfg: dict) -> _Params:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
        raise ConvertError(
            "config.json has no 'architectures' list; supported architectures: " + ", ".join(ARCHITECTURES))
    hf_arch = archs[0]
    if hf_arch not in ARCHITECTURES:
        raise ConvertError(
            f"unsupported architecture '{hf_arch}'; supported: " + ", ".join(ARCHITECTURES))
    arch = ARCHITECTURES[hf_arch]

    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ConvertError(f"config.json: hidden_act '{act}' is not supported (only silu / SwiGLU)")
    if arch == "deepseek2":
        return _params_deepseek2(cfg, hf_arch)
    n_embd = _int(cfg, "hidden_size")
    n_head = _int(cfg, "num_attention_heads")
    n_head_kv = _int(cfg, "num_key_value_heads", default=n_head)
    if n_head % n_head_kv:
        raise ConvertError(f"config.json: num_attention_heads {n_head} is not a multiple of "
                           f"num_key_value_heads {n_head_kv}")
    if cfg.get("head_dim") is not None:
        head_dim = _int(cfg, "head_dim")
    elif n_embd % n_head == 0:
        head_dim = n_embd // n_head
    else:
        raise ConvertError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads "
                           f"{n_head} and head_dim is not given")
    if head_dim % 2:
        raise ConvertError(f"config.json: head_dim {head_dim} must be even for rope")
    prf = cfg.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise ConvertError(f"config.json: partial_rotary_factor {prf} is not supported")

    n_ctx = _int(cfg, "max_position_embeddings", default=4096)
    window, window_layers = _sliding_window(cfg, hf_arch, n_ctx)
    sw = cfg.get("sliding_window")
    if hf_arch == "LlamaForCausalLM" and isinstance(sw, int) and 0 < sw < n_ctx:
        raise ConvertError(f"config.json: sliding_window {sw} < max_position_embeddings {n_ctx} on a "
                           "LlamaForCausalLM, which transformers runs without a window; remove the field or "
                           "name the model MistralForCausalLM if it was trained with one")

    attn_bias = bool(cfg.get("attention_bias", False))
    if arch in ("qwen2", "qwen2moe"):
        attn_bias = bool(cfg.get("qkv_bias", True)) if arch == "qwen2moe" else True
    elif attn_bias:
        raise ConvertError(f"config.json: attention_bias is true; {arch} in TensorFold has no Q/K/V biases")
    if cfg.get("mlp_bias"):
        raise ConvertError("config.json: mlp_bias is true; MLP biases are not supported")

    base, scaling = _rope(cfg)
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise ConvertError(f"config.json: rms_norm_eps {eps!r} is invalid")
    tied = cfg.get("tie_word_embeddings")
    p = _Params(
        hf_arch=hf_arch, arch=arch, n_embd=n_embd, n_layer=_int(cfg, "num_hidden_layers"),
        n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=_int(cfg, "intermediate_size"), n_vocab=_int(cfg, "vocab_size"), n_ctx=n_ctx,
        rms_eps=float(eps), rope_base=base, rope_scaling=scaling,
        tied=None if tied is None else bool(tied), attn_bias=attn_bias, sliding_window=window,
        window_layers=window_layers,
    )
    if hf_arch == "MixtralForCausalLM":
        p.n_expert = _int(cfg, "num_local_experts", "num_experts")
        p.n_expert_used = _int(cfg, "num_experts_per_tok")
        p.n_ff_exp = p.n_ff
        p.norm_topk = True  # Mixtral always renormalises its top-k softmax weights
    elif arch in ("qwen2moe", "qwen3moe"):
        p.n_expert = _int(cfg, "num_experts", "num_local_experts")
        p.n_expert_used = _int(cfg, "num_experts_per_tok")
        p.n_ff_exp = _int(cfg, "moe_intermediate_size")
        p.norm_topk = bool(cfg.get("norm_topk_prob", False))
        step = cfg.get("decoder_sparse_step", 1)
        if step != 1:
            raise ConvertError(f"config.json: decoder_sparse_step = {step}; only every-layer MoE (1) is supported")
        if cfg.get("mlp_only_layers"):
            raise ConvertError(f"config.json: mlp_only_layers = {cfg['mlp_only_layers']}; "
                               "mixed dense/MoE layers are not supported")
        if arch == "qwen2moe":
            p.n_ff_shexp = _int(cfg, "shared_expert_intermediate_size")
    if p.is_moe and p.n_expert_used > p.n_expert:
        raise ConvertError(f"config.json: num_experts_per_tok {p.n_expert_used} > number of experts {p.n_expert}")
    return p


def _sliding_window(cfg: dict, hf_arch: str, n_ctx: int) -> tuple[int, list | None]:
    """The window and which layers have it (None: every layer), as transformers runs the model:
    Mistral/Mixtral window every layer by `sliding_window`; Qwen2 the `layer_types` marked
    sliding_attention when use_sliding_window is on (from max_window_layers when absent). A
    window at least as long as the context changes nothing and is left out. Anything else that
    asks for a window is refused, not silently run without it."""
    sw = cfg.get("sliding_window")
    use = cfg.get("use_sliding_window")
    layer_types = cfg.get("layer_types")
    n_layer = _int(cfg, "num_hidden_layers")

    def window() -> int:
        if isinstance(sw, bool) or not isinstance(sw, int) or sw < 1:
            raise ConvertError(f"config.json: sliding_window {sw!r} is not a positive integer")
        return sw if sw < n_ctx else 0

    if hf_arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window(), None) if sw is not None else (0, None)
    if hf_arch == "Qwen2ForCausalLM" and use is True and sw is not None:
        if layer_types is None:
            first = cfg.get("max_window_layers", n_layer)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise ConvertError(f"config.json: max_window_layers {first!r} is not an integer >= 0")
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layer or \
                not set(layer_types) <= {"full_attention", "sliding_attention"}:
            raise ConvertError(f"config.json: layer_types must name full_attention or sliding_attention for each of "
                               f"the {n_layer} layers")
        w = window()
        windowed = [t == "sliding_attention" for t in layer_types]
        if w == 0 or not any(windowed):
            return 0, None
        return w, None if all(windowed) else windowed
    if use is True:
        raise ConvertError(f"config.json: use_sliding_window is true; {hf_arch} with sliding-window attention "
                           "is not supported")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        raise ConvertError(f"config.json: layer_types {sorted(set(layer_types))} include non-full attention, "
                           "which is not supported")
    return 0, None


# transformers' class defaults for fields a DeepSeek config.json may leave out (the model
# then uses these, so the GGUF must describe them too)
_DEEPSEEK_DEFAULTS = {
    "DeepseekV2ForCausalLM": dict(first_k_dense_replace=0, n_shared_experts=2, routed_scaling_factor=1.0,
                                  norm_topk_prob=False, topk_method="greedy", scoring_func="softmax"),
    "DeepseekV3ForCausalLM": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                                  n_group=8, topk_group=4),
}
_GATING = {"softmax": 1, "sigmoid": 2}  # gguf.ExpertGatingFuncType


def _params_deepseek2(cfg: dict, hf_arch: str) -> _Params:
    """DeepSeek V2 / V3 (multi-head latent attention + DeepSeekMoE) → deepseek2."""
    d = _DEEPSEEK_DEFAULTS[hf_arch]
    version = "V2" if hf_arch == "DeepseekV2ForCausalLM" else "V3"

    def get(key: str):  # a missing or null field: transformers' default
        v = cfg.get(key)
        return d.get(key) if v is None else v

    def count(key: str, minimum: int = 0) -> int:  # missing: the default; null: none (0)
        raw = cfg[key] if key in cfg else d.get(key)
        v = 0 if raw is None else raw
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConvertError(f"config.json: {key} = {raw!r} is not an integer >= {minimum}")
        return v

    n_embd = _int(cfg, "hidden_size")
    n_layer = _int(cfg, "num_hidden_layers")
    n_head = _int(cfg, "num_attention_heads")
    n_head_kv = cfg.get("num_key_value_heads")
    if n_head_kv is not None and n_head_kv != n_head:
        raise ConvertError(f"config.json: num_key_value_heads {n_head_kv} != num_attention_heads {n_head}; "
                           "DeepSeek's latent attention expands the latent to every head")
    kv_lora = _int(cfg, "kv_lora_rank")
    q_lora = cfg.get("q_lora_rank")
    q_lora = 0 if q_lora in (None, 0) else _int(cfg, "q_lora_rank")
    nope, rope, v_head = _int(cfg, "qk_nope_head_dim"), _int(cfg, "qk_rope_head_dim"), _int(cfg, "v_head_dim")
    if rope % 2:
        raise ConvertError(f"config.json: qk_rope_head_dim {rope} must be even for rope")
    if cfg.get("attention_bias"):
        raise ConvertError("config.json: attention_bias is true; deepseek2 has no attention biases")
    if cfg.get("mlp_bias"):
        raise ConvertError("config.json: mlp_bias is true; MLP biases are not supported")
    prf = cfg.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1, 1.0):
        raise ConvertError(f"config.json: partial_rotary_factor {prf} is not supported")
    if cfg.get("use_sliding_window") is True:
        raise ConvertError("config.json: use_sliding_window is true; sliding-window attention is not supported")

    # MoE layout: the first first_k_dense_replace layers are dense, every later one is MoE
    n_expert = _int(cfg, "n_routed_experts", "num_local_experts")
    n_used = _int(cfg, "num_experts_per_tok")
    if n_used > n_expert:
        raise ConvertError(f"config.json: num_experts_per_tok {n_used} > n_routed_experts {n_expert}")
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        raise ConvertError(f"config.json: moe_layer_freq = {freq!r}; deepseek2 in llama.cpp / TensorFold "
                           "can only describe MoE in every layer after the first_k_dense_replace dense ones (1)")
    n_dense = count("first_k_dense_replace")
    if n_dense > n_layer:
        raise ConvertError(f"config.json: first_k_dense_replace {n_dense} > num_hidden_layers {n_layer}")
    n_shared = count("n_shared_experts")

    scoring = get("scoring_func")
    want = d["scoring_func"]
    if scoring != want:
        raise ConvertError(f"config.json: scoring_func '{scoring}' is not supported for {hf_arch} "
                           f"(DeepSeek {version} routers use '{want}')")
    method = get("topk_method")
    n_group, topk_group = cfg.get("n_group"), cfg.get("topk_group")
    groups: tuple[int, int] | None = None
    if version == "V2":
        if method not in ("greedy", "group_limited_greedy"):
            raise ConvertError(f"config.json: topk_method '{method}' is not supported for {hf_arch} "
                               "(supported: greedy; group_limited_greedy only when it selects every group)")
        grouped = isinstance(n_group, int) and isinstance(topk_group, int) and 1 < n_group and topk_group < n_group
        if method == "group_limited_greedy" and grouped:
            raise ConvertError(
                f"config.json: topk_method group_limited_greedy with n_group {n_group} / topk_group {topk_group} "
                "ranks expert groups by their best expert; deepseek2's expert_group_count / expert_group_used_count "
                "rank groups by the sum of their two best experts (DeepSeek V3's noaux_tc), so this routing "
                "cannot be represented")
        # greedy ignores groups; write them (as llama.cpp does) only where they cannot group
        if isinstance(n_group, int) and isinstance(topk_group, int) and n_group <= 1:
            groups = (n_group, topk_group)
    else:
        if method != "noaux_tc":
            raise ConvertError(f"config.json: topk_method '{method}' is not supported for {hf_arch} "
                               "(DeepSeek V3 routers use noaux_tc)")
        n_group, topk_group = count("n_group", 1), count("topk_group", 1)
        if n_group > 1 and topk_group < n_group:
            if n_expert % n_group or n_expert // n_group < 2:
                raise ConvertError(f"config.json: n_routed_experts {n_expert} cannot be split into n_group "
                                   f"{n_group} groups of at least two experts")
            groups = (n_group, topk_group)
        elif n_group <= 1:
            groups = (n_group, topk_group)
        # topk_group >= n_group > 1 selects every group: no groups written (llama.cpp's loader
        # insists on expert_group_used_count < expert_group_count)
    scale = get("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ConvertError(f"config.json: routed_scaling_factor = {scale!r} is invalid")

    base, scaling, log_mul = _rope_deepseek2(cfg)
    interleave = True
    if version == "V3":
        ri = cfg.get("rope_interleave", True)
        if not isinstance(ri, bool):
            raise ConvertError(f"config.json: rope_interleave = {ri!r} is not a boolean")
        interleave = ri
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise ConvertError(f"config.json: rms_norm_eps {eps!r} is invalid")
    tied = cfg.get("tie_word_embeddings")
    p = _Params(
        hf_arch=hf_arch, arch="deepseek2", n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=1,
        head_dim=nope + rope, n_ff=_int(cfg, "intermediate_size"), n_vocab=_int(cfg, "vocab_size"),
        n_ctx=_int(cfg, "max_position_embeddings", default=4096), rms_eps=float(eps), rope_base=base,
        rope_scaling=scaling, tied=None if tied is None else bool(tied),
        n_expert=n_expert, n_expert_used=n_used, n_ff_exp=_int(cfg, "moe_intermediate_size"),
        norm_topk=bool(get("norm_topk_prob")),
    )
    p.n_ff_shexp = p.n_ff_exp * n_shared
    p.mla = _Mla(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope=nope, qk_rope=rope, v_head=v_head,
                 n_dense_lead=n_dense, n_expert_shared=n_shared, weights_scale=float(scale),
                 gating=_GATING[scoring], groups=groups, yarn_log_mul=log_mul, rope_interleave=interleave)
    return p


def _rope_deepseek2(cfg: dict) -> tuple[float, list | None, float | None]:
    """rope base, rope.scaling.* rows and yarn_log_multiplier for deepseek2. llama.cpp's deepseek2
    applies YaRN the DeepSeek way: cos/sin unscaled and the attention scale multiplied by
    (0.1 * mscale_all_dim * ln(factor) + 1)^2, which is what transformers computes when mscale ==
    mscale_all_dim; other combinations (and linear scaling, which deepseek2 would also rescale)
    cannot be represented."""
    base, rows = _rope(cfg)
    if not rows:
        return base, None, None
    params = cfg.get("rope_parameters")
    scaling = params if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params) \
        else cfg.get("rope_scaling")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ConvertError(f"config.json: rope scaling '{kind}' is not supported for deepseek2 (only yarn)")
    if scaling.get("attention_factor") is not None:
        raise ConvertError("config.json: yarn attention_factor is not supported for deepseek2 (llama.cpp derives "
                           "the attention scaling from mscale_all_dim alone)")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (mscale, mscale_all))
    if not ok or mscale != mscale_all:
        raise ConvertError(
            f"config.json: yarn with mscale = {mscale!r} and mscale_all_dim = {mscale_all!r} cannot be represented "
            "for deepseek2: llama.cpp stores only mscale_all_dim (rope.scaling.yarn_log_multiplier) and assumes "
            "mscale == mscale_all_dim, as in DeepSeek's own configs")
    return base, rows, 0.1 * float(mscale_all)


# --------------------------------------------------------------------------------------
# tensor plan


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a Q or K projection (or bias) from Hugging Face's rotate-half
    layout to the adjacent-pair layout of llama.cpp's NORM rope: within each head of size d,
    output row 2*i + j is input row j*d/2 + i (i < d/2, j in {0, 1})."""
    rows = w.shape[0]
    d = rows // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, 2, d // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


@dataclass
class _Out:
    name: str
    shape: tuple[int, ...]          # numpy order
    sources: list[str]
    make: Callable[[list[np.ndarray]], np.ndarray]
    keep_f32: bool = False          # norms, biases, routers
    ggml_type: int = _GGML_F32
    nbytes: int = 0
    note: str = ""
    order: tuple = field(default_factory=tuple)


def _one(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0]


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.stack(arrays, axis=0)


def _plan(p: _Params, src: _Source) -> list[_Out]:
    outs: list[_Out] = []
    used: set[str] = set()

    def shape_of(name: str) -> tuple[int, ...]:
        if name not in src:
            raise ConvertError(f"tensor {name} is missing from the checkpoint")
        return src.shape[name]

    def expect(name: str, shape: tuple[int, ...]) -> None:
        got = shape_of(name)
        if got != shape:
            raise ConvertError(f"tensor {name} has shape {list(got)}, expected {list(shape)} from config.json")

    def add(gname: str, hname: str, shape: tuple[int, ...], keep_f32=False, make=_one,
            out_shape: tuple[int, ...] | None = None) -> None:
        expect(hname, shape)
        used.add(hname)
        outs.append(_Out(gname, out_shape or shape, [hname], make, keep_f32))

    def add_stack(gname: str, hnames: list[str], shape: tuple[int, ...]) -> None:
        for h in hnames:
            expect(h, shape)
            used.add(h)
        outs.append(_Out(gname, (len(hnames), *shape), hnames, _stack))

    def add_fused(gname: str, hname: str, shape: tuple[int, ...], part: slice | None) -> None:
        # transformers-5 fused expert tensors: gate_up_proj [E, 2*ff, embd], down_proj [E, embd, ff]
        used.add(hname)
        full = shape_of(hname)
        if part is None:
            if full != shape:
                raise ConvertError(f"tensor {hname} has shape {list(full)}, expected {list(shape)}")
            outs.append(_Out(gname, shape, [hname], _one))
        else:
            want = (shape[0], 2 * shape[1], shape[2])
            if full != want:
                raise ConvertError(f"tensor {hname} has shape {list(full)}, expected {list(want)}")
            outs.append(_Out(gname, shape, [hname], lambda a, s=part: np.ascontiguousarray(a[0][:, s, :])))

    def add_experts(b: str, moe: str, n: int, F: int) -> None:
        if f"{moe}.experts.gate_up_proj" in src:  # fused (transformers 5 in-memory layout)
            add_fused(f"{b}.ffn_gate_exps.weight", f"{moe}.experts.gate_up_proj", (n, F, E), slice(0, F))
            add_fused(f"{b}.ffn_up_exps.weight", f"{moe}.experts.gate_up_proj", (n, F, E), slice(F, 2 * F))
            add_fused(f"{b}.ffn_down_exps.weight", f"{moe}.experts.down_proj", (n, E, F), None)
        else:
            if p.hf_arch == "MixtralForCausalLM" and f"{moe}.experts.0.w1.weight" in src:
                gate, up, down = "w1", "w3", "w2"
            else:
                gate, up, down = "gate_proj", "up_proj", "down_proj"
            ex = [f"{moe}.experts.{e}" for e in range(n)]
            add_stack(f"{b}.ffn_gate_exps.weight", [f"{x}.{gate}.weight" for x in ex], (F, E))
            add_stack(f"{b}.ffn_up_exps.weight", [f"{x}.{up}.weight" for x in ex], (F, E))
            add_stack(f"{b}.ffn_down_exps.weight", [f"{x}.{down}.weight" for x in ex], (E, F))

    E, H, V = p.n_embd, p.n_embd, p.n_vocab
    add("token_embd.weight", "model.embed_tokens.weight", (V, E))
    q_rows, kv_rows = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    norm_rope = p.arch == "llama"
    if p.mla is not None:
        _plan_deepseek2_layers(p, src, add, add_experts)
    else:
        for i in range(p.n_layer):
            hf = f"model.layers.{i}"
            b = f"blk.{i}"
            add(f"{b}.attn_norm.weight", f"{hf}.input_layernorm.weight", (E,), True)
            for g, h, rows, nh in (("attn_q", "q_proj", q_rows, p.n_head),
                                   ("attn_k", "k_proj", kv_rows, p.n_head_kv),
                                   ("attn_v", "v_proj", kv_rows, 0)):
                perm = (lambda a, n=nh: permute_qk(a[0], n)) if (norm_rope and nh) else _one
                add(f"{b}.{g}.weight", f"{hf}.self_attn.{h}.weight", (rows, H), make=perm)
                if p.attn_bias:
                    add(f"{b}.{g}.bias", f"{hf}.self_attn.{h}.bias", (rows,), True)
                elif f"{hf}.self_attn.{h}.bias" in src:
                    raise ConvertError(f"tensor {hf}.self_attn.{h}.bias present but {p.arch} has no attention biases")
            add(f"{b}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (H, q_rows))
            if p.arch in ("qwen3", "qwen3moe"):
                add(f"{b}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (p.head_dim,), True)
                add(f"{b}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (p.head_dim,), True)
            add(f"{b}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (E,), True)

            if not p.is_moe:
                add(f"{b}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (p.n_ff, E))
                add(f"{b}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (p.n_ff, E))
                add(f"{b}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (E, p.n_ff))
                continue

            moe = f"{hf}.block_sparse_moe" if p.hf_arch == "MixtralForCausalLM" else f"{hf}.mlp"
            if p.hf_arch == "MixtralForCausalLM" and f"{moe}.gate.weight" not in src and f"{hf}.mlp.gate.weight" in src:
                moe = f"{hf}.mlp"
            router = f"{moe}.gate.weight" if f"{moe}.gate.weight" in src else f"{moe}.router.weight"
            add(f"{b}.ffn_gate_inp.weight", router, (p.n_expert, E), True)
            add_experts(b, moe, p.n_expert, p.n_ff_exp)
            if p.arch == "qwen2moe":
                S = p.n_ff_shexp
                add(f"{b}.ffn_gate_inp_shexp.weight", f"{moe}.shared_expert_gate.weight", (1, E), True)
                add(f"{b}.ffn_gate_shexp.weight", f"{moe}.shared_expert.gate_proj.weight", (S, E))
                add(f"{b}.ffn_up_shexp.weight", f"{moe}.shared_expert.up_proj.weight", (S, E))
                add(f"{b}.ffn_down_shexp.weight", f"{moe}.shared_expert.down_proj.weight", (E, S))

    add("output_norm.weight", "model.norm.weight", (E,), True)
    has_head = "lm_head.weight" in src
    tied = p.tied if p.tied is not None else not has_head
    if not tied:
        if not has_head:
            raise ConvertError("tie_word_embeddings is false but lm_head.weight is missing from the checkpoint")
        add("output.weight", "lm_head.weight", (V, E))
    elif has_head:
        # tied, yet a separate head was saved: accept it only if it really is the embedding
        expect("lm_head.weight", (V, E))
        if not np.array_equal(src.get("lm_head.weight"), src.get("model.embed_tokens.weight")):
            raise ConvertError("tie_word_embeddings is true but lm_head.weight differs from "
                               "model.embed_tokens.weight; fix config.json")
        used.add("lm_head.weight")
    p.tied = tied

    ignorable = re.compile(r"(rotary_emb\.inv_freq|\.e_score_correction_bias)$")
    left = sorted(n for n in src.names() if n not in used and not ignorable.search(n))
    if p.mla is not None:
        # Layers past the multi-token-prediction ones (an MTP layer without its eh_proj): skipped
        last = p.n_layer + p.mla.n_nextn
        mtp = {n for n in src.names()
               if (m := re.match(r"model\.layers\.(\d+)\.", n)) and int(m.group(1)) >= last}
        if mtp:
            log.info("skipping %d tensors of layers >= %d (no eh_proj: not a whole multi-token-prediction "
                     "layer)", len(mtp), last)
        # here a correction bias is a tensor like any other: one this plan did not use is an error
        left = sorted(n for n in src.names()
                      if n not in used and n not in mtp and not n.endswith("rotary_emb.inv_freq"))
    if left:
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise ConvertError(f"the checkpoint has tensors this converter does not map: {', '.join(left[:5])}{more}; "
                           "the model is not a plain " + p.hf_arch)
    # read roughly shard by shard: order by the first shard each output tensor needs
    for k, o in enumerate(outs):
        o.order = (min(src.file_of[s] for s in o.sources), k)
    outs.sort(key=lambda o: o.order)
    return outs


def _rope_rows_perm(rows: int, block: int, start: int, rope: int) -> np.ndarray:
    """Row order that turns HF's rotate-half rope rows into llama.cpp's adjacent pairs: in each
    block of ``block`` rows, the ``rope`` rows from offset ``start`` get GGUF row start + 2i + j =
    HF row start + j*rope/2 + i (see permute_qk); every other row stays."""
    idx = np.arange(rows).reshape(rows // block, block)
    part = idx[:, start:start + rope].reshape(-1, 2, rope // 2).swapaxes(1, 2).reshape(-1, rope)
    idx = idx.copy()
    idx[:, start:start + rope] = part
    return idx.reshape(rows)


def _plan_deepseek2_layers(p: _Params, src: _Source, add, add_experts) -> None:
    """The per-layer tensors of deepseek2, with llama.cpp's names and layouts."""
    m = p.mla
    assert m is not None
    E, nh = p.n_embd, p.n_head
    nope, rope, kv, vd = m.qk_nope, m.qk_rope, m.kv_lora_rank, m.v_head
    qk = nope + rope
    q_rows = nh * qk

    def rows(order: np.ndarray | None):
        if order is None:
            return _one
        return lambda a, o=order: np.ascontiguousarray(a[0][o])

    q_order = kv_a_order = None
    if not m.rope_interleave:  # HF rotates halves: reorder the rope rows to adjacent pairs
        q_order = _rope_rows_perm(q_rows, qk, nope, rope)
        kv_a_order = _rope_rows_perm(kv + rope, kv + rope, kv, rope)

    def k_b(a: list[np.ndarray]) -> np.ndarray:  # [nh*(nope+v), kv] → [nh, kv, nope]
        w = a[0].reshape(nh, nope + vd, kv)
        return np.ascontiguousarray(w[:, :nope, :].transpose(0, 2, 1))

    def v_b(a: list[np.ndarray]) -> np.ndarray:  # [nh*(nope+v), kv] → [nh, v, kv]
        return np.ascontiguousarray(a[0].reshape(nh, nope + vd, kv)[:, nope:, :])

    # DeepSeek's multi-token-prediction (MTP) layers follow the last layer: kept as llama.cpp's
    # nextn layers (blk.N+j: a decoder layer plus eh_proj, enorm, hnorm and the shared head's
    # norm), the draft head of speculative decoding.
    m.n_nextn = 0
    while p.keep_mtp and f"model.layers.{p.n_layer + m.n_nextn}.eh_proj.weight" in src:
        m.n_nextn += 1
    V = p.n_vocab
    for i in range(p.n_layer + m.n_nextn):
        hf, b = f"model.layers.{i}", f"blk.{i}"
        at = f"{hf}.self_attn"
        if i >= p.n_layer:
            add(f"{b}.nextn.eh_proj.weight", f"{hf}.eh_proj.weight", (E, 2 * E))
            add(f"{b}.nextn.enorm.weight", f"{hf}.enorm.weight", (E,), True)
            add(f"{b}.nextn.hnorm.weight", f"{hf}.hnorm.weight", (E,), True)
            add(f"{b}.nextn.shared_head_norm.weight", f"{hf}.shared_head.norm.weight", (E,), True)
            if f"{hf}.embed_tokens.weight" in src:
                add(f"{b}.nextn.embed_tokens.weight", f"{hf}.embed_tokens.weight", (V, E))
            if f"{hf}.shared_head.head.weight" in src:
                add(f"{b}.nextn.shared_head_head.weight", f"{hf}.shared_head.head.weight", (V, E))
        add(f"{b}.attn_norm.weight", f"{hf}.input_layernorm.weight", (E,), True)
        if m.q_lora_rank:
            if f"{at}.q_proj.weight" in src:
                raise ConvertError(f"tensor {at}.q_proj.weight present but config.json sets q_lora_rank "
                                   f"{m.q_lora_rank} (q_a_proj / q_b_proj expected)")
            add(f"{b}.attn_q_a.weight", f"{at}.q_a_proj.weight", (m.q_lora_rank, E))
            add(f"{b}.attn_q_a_norm.weight", f"{at}.q_a_layernorm.weight", (m.q_lora_rank,), True)
            add(f"{b}.attn_q_b.weight", f"{at}.q_b_proj.weight", (q_rows, m.q_lora_rank), make=rows(q_order))
        else:
            if f"{at}.q_a_proj.weight" in src:
                raise ConvertError(f"tensor {at}.q_a_proj.weight present but config.json has no q_lora_rank")
            add(f"{b}.attn_q.weight", f"{at}.q_proj.weight", (q_rows, E), make=rows(q_order))
        add(f"{b}.attn_kv_a_mqa.weight", f"{at}.kv_a_proj_with_mqa.weight", (kv + rope, E), make=rows(kv_a_order))
        add(f"{b}.attn_kv_a_norm.weight", f"{at}.kv_a_layernorm.weight", (kv,), True)
        kv_b = f"{at}.kv_b_proj.weight"
        add(f"{b}.attn_k_b.weight", kv_b, (nh * (nope + vd), kv), make=k_b, out_shape=(nh, kv, nope))
        add(f"{b}.attn_v_b.weight", kv_b, (nh * (nope + vd), kv), make=v_b, out_shape=(nh, vd, kv))
        add(f"{b}.attn_output.weight", f"{at}.o_proj.weight", (E, nh * vd))
        add(f"{b}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (E,), True)
        mlp = f"{hf}.mlp"
        if i < m.n_dense_lead:
            add(f"{b}.ffn_gate.weight", f"{mlp}.gate_proj.weight", (p.n_ff, E))
            add(f"{b}.ffn_up.weight", f"{mlp}.up_proj.weight", (p.n_ff, E))
            add(f"{b}.ffn_down.weight", f"{mlp}.down_proj.weight", (E, p.n_ff))
            continue
        add(f"{b}.ffn_gate_inp.weight", f"{mlp}.gate.weight", (p.n_expert, E), True)
        if f"{mlp}.gate.e_score_correction_bias" in src:
            if m.gating != _GATING["sigmoid"]:
                raise ConvertError(f"tensor {mlp}.gate.e_score_correction_bias present but {p.hf_arch} "
                                   "routers have no correction bias")
            add(f"{b}.exp_probs_b.bias", f"{mlp}.gate.e_score_correction_bias", (p.n_expert,), True)
        add_experts(b, mlp, p.n_expert, p.n_ff_exp)
        if m.n_expert_shared:
            S = p.n_ff_shexp
            add(f"{b}.ffn_gate_shexp.weight", f"{mlp}.shared_experts.gate_proj.weight", (S, E))
            add(f"{b}.ffn_up_shexp.weight", f"{mlp}.shared_experts.up_proj.weight", (S, E))
            add(f"{b}.ffn_down_shexp.weight", f"{mlp}.shared_experts.down_proj.weight", (E, S))


def _choose_types(outs: list[_Out], outtype: str) -> None:
    for o in outs:
        if o.keep_f32 or len(o.shape) == 1:
            o.ggml_type = _GGML_F32
        else:
            o.ggml_type, o.note = _weight_type(o.shape, outtype)
        o.nbytes = _tensor_nbytes(o.shape, o.ggml_type)


def _weight_type(shape: tuple[int, ...], outtype: str) -> tuple[int, str]:
    """(GGML type, note for the log) of a weight of numpy ``shape`` written as ``outtype``:
    Q8_0 blocks run along the rows, so rows that are not a multiple of 32 fall back to F16."""
    if outtype == "f32":
        return _GGML_F32, ""
    if outtype == "f16":
        return _GGML_F16, ""
    if outtype == "bf16":
        return _GGML_BF16, ""
    if shape[-1] % 32 == 0:
        return _GGML_Q8_0, ""
    return _GGML_F16, f"row length {shape[-1]} is not a multiple of 32: stored as F16 instead of Q8_0"


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of numpy ``shape`` stored as ``ggml_type`` (plain or block type)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    return int(np.prod(quant_shape_to_byte_shape(shape, Q(ggml_type))))


def _encode(arr: np.ndarray, t: int) -> np.ndarray:
    if t == _GGML_F32:
        return np.ascontiguousarray(arr, dtype=np.float32)
    if t == _GGML_F16:
        return np.ascontiguousarray(arr, dtype=np.float16)
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(arr, dtype=np.float32), Q(t))


# --------------------------------------------------------------------------------------
# tokenizer


def _token_content(tok: Any) -> str | None:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def _walk_pre(pre: Any) -> list[dict]:
    if not isinstance(pre, dict):
        return []
    if pre.get("type") == "Sequence":
        out: list[dict] = []
        for x in pre.get("pretokenizers", []):
            out += _walk_pre(x)
        return out
    return [pre]


# The Split regexes of tokenizer.json files, as Hugging Face writes them.
_HF_SPLIT_REGEX = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
RECOGNISED_PRE = (
    "llama-bpe: Split(llama-3 regex) + ByteLevel(use_regex=false)",
    "qwen2: Split(Qwen2 regex) + ByteLevel(use_regex=false)",
    "smollm: Digits(individual_digits=true) + ByteLevel(use_regex=true)",
    "gpt-2: ByteLevel(use_regex=true) alone",
)


def _describe_pre(steps: list[dict]) -> str:
    if not steps:
        return "none"
    parts = []
    for s in steps:
        t = str(s.get("type"))
        if t == "Split":
            pat = s.get("pattern")
            t += f"({json.dumps(pat)[:120]})"
        elif t == "ByteLevel":
            t += f"(use_regex={str(s.get('use_regex', True)).lower()})"
        parts.append(t)
    return " + ".join(parts)


def choose_pre(arch: str, tok: dict) -> str:
    """``tokenizer.ggml.pre`` by the rule in the module docstring; ConvertError when the
    pre-tokenizer is none of the recognised ones. (``arch`` is kept for the signature: the
    architecture alone does not decide how a tokenizer splits text.)"""
    steps = _walk_pre(tok.get("pre_tokenizer"))
    types = [s.get("type") for s in steps]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if byte_level and any(s.get("add_prefix_space") for s in byte_level):
        pass  # llama.cpp never adds a prefix space: falls through to the error
    elif types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        sp = steps[0]
        pattern = sp.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if sp.get("behavior", "Isolated") == "Isolated" and not sp.get("invert", False):
            for name, known in _HF_SPLIT_REGEX.items():
                if regex == known:
                    return name
    elif types == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    elif types == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    raise ConvertError(
        f"tokenizer.json: the pre-tokenizer [{_describe_pre(steps)}] is not one TensorFold recognises, "
        f"and a wrong guess would split text differently from the source tokenizer. Recognised: "
        + "; ".join(RECOGNISED_PRE)
        + ". If you know which llama.cpp pre-tokenizer matches it, name it with --pre NAME "
          "(pre= in Python).")


def _tokenizer_kv(hf_dir: str, p: _Params, cfg: dict, pre: str | None = None) -> list[tuple[str, str, Any]]:
    tj_path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tj_path):
        if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")):
            raise ConvertError(f"{hf_dir}: SentencePiece vocabularies (tokenizer.model) are not supported yet; "
                               "a byte-level BPE tokenizer.json is required")
        raise ConvertError(f"tokenizer.json not found in {hf_dir} (a byte-level BPE tokenizer.json is required)")
    tok = _read_json(tj_path, "tokenizer.json")
    model = tok.get("model") or {}
    if model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConvertError(f"{tj_path}: tokenizer model '{model.get('type')}' is not supported yet "
                           "(only byte-level BPE)")
    byte_level = any(s.get("type") == "ByteLevel" for s in _walk_pre(tok.get("pre_tokenizer")))
    dec = tok.get("decoder") or {}
    byte_level = byte_level or dec.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in dec.get("decoders", []) if isinstance(d, dict))
    if not byte_level:
        raise ConvertError(f"{tj_path}: a BPE tokenizer without ByteLevel pre-tokenization "
                           "(SentencePiece-style) is not supported yet")
    tcfg = _read_json(os.path.join(hf_dir, "tokenizer_config.json"), "tokenizer_config.json", required=False) or {}
    gcfg = _read_json(os.path.join(hf_dir, "generation_config.json"), "generation_config.json", required=False) or {}

    vocab: dict[str, int] = model["vocab"]
    id_to_tok: dict[int, str] = {}
    types: dict[int, int] = {}
    for t, i in vocab.items():
        if not isinstance(i, int) or i < 0:
            raise ConvertError(f"{tj_path}: token {t!r} has an invalid id {i!r}")
        id_to_tok[i] = t
        types[i] = TOKEN_NORMAL
    for at in tok.get("added_tokens") or []:
        i, c = at.get("id"), at.get("content")
        if not isinstance(i, int) or i < 0 or not isinstance(c, str):
            raise ConvertError(f"{tj_path}: invalid added token {at!r}")
        id_to_tok[i] = c
        types[i] = TOKEN_CONTROL if at.get("special") else TOKEN_USER_DEFINED
    n_tok = max(id_to_tok) + 1
    if n_tok > p.n_vocab:
        raise ConvertError(f"tokenizer has token id {n_tok - 1} but the model's vocab_size is {p.n_vocab}")
    tokens, ttypes = [], []
    for i in range(p.n_vocab):  # pad to the embedding size (gaps and tail are unused slots)
        if i in id_to_tok:
            tokens.append(id_to_tok[i])
            ttypes.append(types[i])
        else:
            tokens.append(f"[PAD{i}]")
            ttypes.append(TOKEN_UNUSED)
    text_to_id = {t: i for i, t in enumerate(tokens)}

    merges = []
    for m in model.get("merges") or []:
        if isinstance(m, str):
            merges.append(m)
        elif isinstance(m, (list, tuple)) and len(m) == 2 and all(isinstance(x, str) for x in m):
            merges.append(f"{m[0]} {m[1]}")
        else:
            raise ConvertError(f"{tj_path}: invalid merge {m!r}")

    def special_id(name: str) -> int | None:
        c = _token_content(tcfg.get(f"{name}_token"))
        if c is not None:
            if c not in text_to_id:
                raise ConvertError(f"tokenizer_config.json: {name}_token {c!r} is not in the vocabulary")
            return text_to_id[c]
        for src in (cfg, gcfg):
            v = src.get(f"{name}_token_id")
            if isinstance(v, list):
                v = v[0] if v else None
            if isinstance(v, int) and 0 <= v < p.n_vocab:
                return v
        return None

    kv: list[tuple[str, str, Any]] = [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", pre or choose_pre(p.arch, tok)),
        ("tokenizer.ggml.tokens", "arr", tokens),
        ("tokenizer.ggml.token_type", "arr_i32", ttypes),
        ("tokenizer.ggml.merges", "arr", merges),
    ]
    bos = special_id("bos")
    for name, v in (("bos", bos), ("eos", special_id("eos")), ("padding", special_id("pad"))):
        if v is not None:
            kv.append((f"tokenizer.ggml.{name}_token_id", "u32", v))

    add_bos = tcfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = _post_processor_adds_bos(tok, bos, tokens)
        if add_bos is None:
            # no explicit setting: Qwen templates expect no BOS, llama-3 style ones do
            add_bos = (not p.arch.startswith("qwen")) and bos is not None
    kv.append(("tokenizer.ggml.add_bos_token", "bool", bool(add_bos)))
    if isinstance(tcfg.get("add_eos_token"), bool):
        kv.append(("tokenizer.ggml.add_eos_token", "bool", tcfg["add_eos_token"]))

    template = _chat_template(hf_dir, tcfg)
    if template:
        kv.append(("tokenizer.chat_template", "str", template))
    return kv


def _post_processor_adds_bos(tok: dict, bos: int | None, tokens: list[str]) -> bool | None:
    """True/False when tokenizer.json's TemplateProcessing decides it, else None."""
    pp = tok.get("post_processor")
    if not isinstance(pp, dict):
        return None
    procs = pp.get("processors", []) if pp.get("type") == "Sequence" else [pp]
    for x in procs:
        if isinstance(x, dict) and x.get("type") == "TemplateProcessing":
            single = x.get("single") or []
            first = single[0] if single else {}
            sp = first.get("SpecialToken") if isinstance(first, dict) else None
            return bool(sp and bos is not None and sp.get("id") == tokens[bos])
    return None


def _chat_template(hf_dir: str, tcfg: dict) -> str | None:
    t = tcfg.get("chat_template")
    if isinstance(t, list):  # named templates: use "default"
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str) and t:
        return t
    path = os.path.join(hf_dir, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    j = _read_json(os.path.join(hf_dir, "chat_template.json"), "chat_template.json", required=False)
    if j and isinstance(j.get("chat_template"), str):
        return j["chat_template"]
    return None


# --------------------------------------------------------------------------------------
# model metadata


def _base_kv(p: _Params, a: str, name: str, outtype: str, *, n_head_kv: int,
             rope_dim: int) -> list[tuple[str, str, Any]]:
    """The keys every architecture writes."""
    return [
        ("general.name", "str", name),
        ("general.file_type", "u32", _FILE_TYPE[outtype]),
        (f"{a}.vocab_size", "u32", p.n_vocab),
        (f"{a}.context_length", "u32", p.n_ctx),
        (f"{a}.embedding_length", "u32", p.n_embd),
        (f"{a}.block_count", "u32", p.n_layer),
        (f"{a}.feed_forward_length", "u32", p.n_ff),
        (f"{a}.attention.head_count", "u32", p.n_head),
        (f"{a}.attention.head_count_kv", "u32", n_head_kv),
        (f"{a}.attention.layer_norm_rms_epsilon", "f32", p.rms_eps),
        (f"{a}.rope.freq_base", "f32", p.rope_base),
        (f"{a}.rope.dimension_count", "u32", rope_dim),
    ]


def _model_kv(p: _Params, name: str, outtype: str) -> list[tuple[str, str, Any]]:
    if p.mla is not None:
        return _model_kv_deepseek2(p, name, outtype)
    a = p.arch
    kv = _base_kv(p, a, name, outtype, n_head_kv=p.n_head_kv, rope_dim=p.head_dim)
    if p.head_dim * p.n_head != p.n_embd:
        kv += [(f"{a}.attention.key_length", "u32", p.head_dim),
               (f"{a}.attention.value_length", "u32", p.head_dim)]
    if p.rope_scaling:
        kv += [(f"{a}.rope.scaling.{k}", t, v) for k, t, v in p.rope_scaling]
    if p.sliding_window:
        kv.append((f"{a}.attention.sliding_window", "u32", p.sliding_window))
        if p.window_layers is not None:  # llama.cpp's per-layer form: true = windowed
            kv.append((f"{a}.attention.sliding_window_pattern", "arr_bool", p.window_layers))
    if p.is_moe:
        kv += [(f"{a}.expert_count", "u32", p.n_expert),
               (f"{a}.expert_used_count", "u32", p.n_expert_used),
               (f"{a}.expert_weights_norm", "bool", p.norm_topk)]
        if a in ("qwen2moe", "qwen3moe"):
            kv.append((f"{a}.expert_feed_forward_length", "u32", p.n_ff_exp))
        if a == "qwen2moe":
            kv.append((f"{a}.expert_shared_feed_forward_length", "u32", p.n_ff_shexp))
    return kv


def _model_kv_deepseek2(p: _Params, name: str, outtype: str) -> list[tuple[str, str, Any]]:
    """llama.cpp's deepseek2 keys (MLA form). Where llama.cpp's converter leaves a key out
    because config.json does not name it, this writes what the model actually does:
    expert_gating_func always (llama.cpp's loader falls back to softmax without it, which is
    wrong for V3), expert_weights_scale always."""
    m = p.mla
    assert m is not None
    a = "deepseek2"
    kv = _base_kv(p, a, name, outtype, n_head_kv=1, rope_dim=m.qk_rope)  # one KV head: the shared latent
    if m.n_nextn:  # llama.cpp counts the next-token-prediction layers in block_count
        kv = [(k, t, p.n_layer + m.n_nextn if k == f"{a}.block_count" else v) for k, t, v in kv]
        kv.append((f"{a}.nextn_predict_layers", "u32", m.n_nextn))
    if p.rope_scaling:
        kv += [(f"{a}.rope.scaling.{k}", t, v) for k, t, v in p.rope_scaling]
    if m.yarn_log_mul is not None:
        kv.append((f"{a}.rope.scaling.yarn_log_multiplier", "f32", m.yarn_log_mul))
    kv.append((f"{a}.leading_dense_block_count", "u32", m.n_dense_lead))
    if m.q_lora_rank:
        kv.append((f"{a}.attention.q_lora_rank", "u32", m.q_lora_rank))
    kv += [
        (f"{a}.attention.kv_lora_rank", "u32", m.kv_lora_rank),
        (f"{a}.attention.key_length", "u32", m.kv_lora_rank + m.qk_rope),
        (f"{a}.attention.value_length", "u32", m.kv_lora_rank),
        (f"{a}.attention.key_length_mla", "u32", m.qk_nope + m.qk_rope),
        (f"{a}.attention.value_length_mla", "u32", m.v_head),
        (f"{a}.expert_feed_forward_length", "u32", p.n_ff_exp),
        (f"{a}.expert_count", "u32", p.n_expert),
        (f"{a}.expert_used_count", "u32", p.n_expert_used),
        (f"{a}.expert_shared_count", "u32", m.n_expert_shared),
        (f"{a}.expert_weights_scale", "f32", m.weights_scale),
        (f"{a}.expert_gating_func", "u32", m.gating),
    ]
    if p.norm_topk:  # llama.cpp writes it only when true
        kv.append((f"{a}.expert_weights_norm", "bool", True))
    if m.groups is not None:
        kv += [(f"{a}.expert_group_count", "u32", m.groups[0]),
               (f"{a}.expert_group_used_count", "u32", m.groups[1])]
    return kv


def _apply_kv(writer, kv: list[tuple[str, str, Any]]) -> None:
    from gguf import GGUFValueType as T

    for key, kind, val in kv:
        if kind == "str":
            writer.add_string(key, val)
        elif kind == "u32":
            writer.add_uint32(key, int(val))
        elif kind == "f32":
            writer.add_float32(key, float(val))
        elif kind == "bool":
            writer.add_bool(key, bool(val))
        elif kind == "arr":
            writer.add_array(key, val)
        elif kind == "arr_bool":
            writer.add_key_value(key, [bool(v) for v in val], T.ARRAY, sub_type=T.BOOL)
        elif kind == "arr_i32":
            writer.add_key_value(key, list(val), T.ARRAY, sub_type=T.INT32)
        else:  # pragma: no cover
            raise AssertionError(kind)


class _PlannedTensor(Protocol):
    """What _write_gguf needs of an output tensor planned by a converter."""
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF ne is the reverse)
    ggml_type: int
    nbytes: int             # what its data will hold, for the tensor table written first
    note: str               # logged when the tensor is written ("" for none)


def _write_gguf(out_path: str, arch: str, kv: list[tuple[str, str, Any]], tensors: Sequence[_PlannedTensor],
                data_of: Callable[[Any], np.ndarray], *, progress: bool) -> None:
    """Write the GGUF ``out_path``: the key/values ``kv`` and the table of ``tensors`` first,
    then each tensor's encoded bytes ``data_of(tensor)``, one at a time, so that memory holds
    one output tensor. Written as OUT_PATH.part and renamed when complete, so that an
    interrupted run never leaves a truncated file under the real name."""
    import gguf

    numpy_dtype = {_GGML_F32: np.float32, _GGML_F16: np.float16, _GGML_I32: np.int32}
    tmp_path = out_path + ".part"
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp_path, arch)
        _apply_kv(writer, kv)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for t in tensors:
            if t.ggml_type in numpy_dtype:
                writer.add_tensor_info(t.name, t.shape, np.dtype(numpy_dtype[t.ggml_type]), t.nbytes)
            else:  # block types and BF16: gguf takes the encoded bytes, told their type
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes,
                                       raw_dtype=gguf.GGMLQuantizationType(t.ggml_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(tensors), desc="convert", unit="tensor", file=sys.stderr)
        try:
            for t in tensors:
                if t.note:
                    msg = f"{t.name}: {t.note}"
                    if bar is not None:  # bar.write keeps the bar whole; logged one level down, not shown twice
                        bar.write(msg, file=sys.stderr)
                        log.info(msg)
                    else:
                        log.warning(msg)
                data = data_of(t)
                if data.nbytes != t.nbytes:  # pragma: no cover - guarded by the plan
                    raise ConvertError(f"{t.name}: {data.nbytes} bytes produced, {t.nbytes} planned")
                writer.write_tensor_data(data)
                del data
                if bar is not None:
                    bar.set_postfix_str(t.name, refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        writer.close()
        writer = None
        os.replace(tmp_path, out_path)
    except BaseException:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


# --------------------------------------------------------------------------------------
# entry points


def convert(hf_dir: str, out_path: str, outtype: str = "f16", *, progress: bool = True,
            pre: str | None = None, mtp: bool = True) -> str:
    """Convert the Hugging Face checkpoint directory ``hf_dir`` into the GGUF ``out_path``.

    ``outtype`` is the type of the 2-D/3-D weights: ``f32``, ``f16`` (default), ``bf16`` or
    ``q8_0`` (tensors whose rows are not a multiple of 32 fall back to F16). Norms, biases
    and routers always stay F32. Returns ``out_path``. Raises :class:`ConvertError` with a
    clear message for inputs it cannot convert. ``pre`` names the tokenizer's pre-tokenizer
    (``tokenizer.ggml.pre``) instead of recognising it from tokenizer.json (see the module
    docstring); it must be a name TensorFold's tokenizer knows. ``mtp`` False drops DeepSeek-V3's
    multi-token-prediction layers (kept by default as llama.cpp's nextn layers: the draft head of
    speculative decoding, ``--draft-mtp``).
    """
    try:
        import gguf  # noqa: F401 - only to fail early, with this message
    except ImportError as e:
        raise ConvertError("the converter needs the 'gguf' package: pip install gguf") from e
    if outtype not in OUTTYPES:
        raise ConvertError(f"outtype {outtype!r} is not one of {', '.join(OUTTYPES)}")
    if pre is not None and pre not in _known_pre():
        raise ConvertError(f"pre-tokenizer {pre!r} is not one of {', '.join(_known_pre())}")
    hf_dir = os.fspath(hf_dir)
    out_path = os.fspath(out_path)
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"{hf_dir} is not a directory (expected a Hugging Face checkpoint directory)")
    cfg = _read_json(os.path.join(hf_dir, "config.json"), "config.json")
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and archs[0] == "DeepseekV4ForCausalLM":
        from .convert_deepseek4 import convert_deepseek4

        return convert_deepseek4(hf_dir, out_path, outtype, cfg, progress=progress, pre=pre)
    p = _params(cfg)
    p.keep_mtp = mtp
    tok_kv = _tokenizer_kv(hf_dir, p, cfg, pre)
    src = _Source(hf_dir)
    try:
        outs = _plan(p, src)
        _choose_types(outs, outtype)

        def data_of(o: _Out) -> np.ndarray:
            arr = o.make([src.get(s) for s in o.sources])
            if arr.shape != o.shape:  # pragma: no cover - guarded by the plan
                raise ConvertError(f"{o.name}: produced shape {arr.shape}, planned {o.shape}")
            return _encode(arr, o.ggml_type)

        log.info("%s (%s) → %s: %d tensors, %s", hf_dir, p.hf_arch, out_path, len(outs), outtype)
        kv = _model_kv(p, _model_name(cfg, hf_dir, p.hf_arch), outtype) + tok_kv
        _write_gguf(out_path, p.arch, kv, outs, data_of, progress=progress)
    finally:
        src.close()
    return out_path


def _model_name(cfg: dict, hf_dir: str, default: str) -> str:
    """general.name: the last part of config.json's _name_or_path, else the directory's name."""
    name = cfg.get("_name_or_path") or os.path.basename(os.path.normpath(hf_dir)) or default
    return os.path.basename(str(name).rstrip("/")) or default


def _known_pre() -> list[str]:
    from .tokenizer import PRE_TOKENIZERS

    return sorted(PRE_TOKENIZERS)


def _cmd(a: argparse.Namespace) -> int:
    # Errors are reported as every command's are ("tensorfold: error: ..."); other exceptions
    # reach tensorfold.cli.main, which does the same.
    from .calibrate import missing_module_error
    from .cli import print_error

    err = missing_module_error("safetensors", "tensorfold convert (reading the checkpoint)", extra="convert")
    if err is not None:
        print_error(str(err))
        return 1
    out = a.output
    if out is None:
        out = os.path.join(a.hf_dir.rstrip("/") or ".", f"model-{a.outtype}.gguf")
    if os.path.exists(out) and not a.force:
        print_error(f"{out} exists (use --force to overwrite)")
        return 2
    try:
        convert(a.hf_dir, out, a.outtype, progress=not a.quiet, pre=a.pre, mtp=not a.no_mtp)
    except ConvertError as e:
        print_error(str(e))
        return 1
    print(out)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tensorfold convert`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Hugging Face safetensors checkpoint directory to GGUF",
        description=(
            "Convert a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json, "
            "tokenizer_config.json) into one GGUF file that TensorFold and llama.cpp load. Supported "
            "architectures: " + ", ".join(f"{k} ({v})" for k, v in ARCHITECTURES.items()) + ". "
            "Weights are streamed one tensor at a time, so memory stays bounded."),
    )
    p.add_argument("hf_dir", help="Hugging Face model directory")
    p.add_argument("-o", "--output", default=None,
                   help="output .gguf path (default: HF_DIR/model-OUTTYPE.gguf)")
    p.add_argument("--outtype", choices=OUTTYPES, default="f16",
                   help="type of the 2-D/3-D weights (default f16); norms, biases and routers stay f32; "
                        "q8_0 falls back to f16 for tensors whose rows are not a multiple of 32")
    p.add_argument("-f", "--force", action="store_true", help="overwrite the output file if it exists")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--pre", metavar="NAME", choices=_known_pre(), default=None,
                   help="for experts: the tokenizer's pre-tokenizer (tokenizer.ggml.pre), when tokenizer.json's "
                        "is not recognised; one of " + ", ".join(_known_pre()))
    p.add_argument("--no-mtp", action="store_true",
                   help="drop DeepSeek's multi-token-prediction layers (kept by default as llama.cpp's nextn "
                        "layers, the draft head of `--draft-mtp`)")
    p.set_defaults(func=_cmd)
    return p


if __name__ == "__main__":  # pragma: no cover - `python -m tensorfold.convert HF_DIR -o out.gguf`
    ap = argparse.ArgumentParser(prog="tensorfold")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    ns = ap.parse_args()
    sys.exit(ns.func(ns))
