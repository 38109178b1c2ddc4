"""Any weight type on any weight, mixed freely (llama.cpp's K-quant mixes give attn_v and
ffn_down more bits than attn_q/attn_k, change types from layer to layer, put token_embd and
output in Q6_K / Q8_0 / F16 / ..., tied or not).

Tiny random transformers models (widths multiples of 256, so every K-quant fits) are
converted to F32 GGUF with `tensorfold convert`, then rewritten with a chosen type per tensor.
The oracle is transformers itself, run with the weights the `gguf` package dequantizes from
the rewritten file. TensorFold multiplies each weight with activations quantized to 8 bits
per block, as llama.cpp does (its vec_dot_type: Q8_0-like blocks of 32 for Q4_0..Q8_0, Q8_K
blocks of 256 for the K-quants, none for F32/F16/BF16). The oracle applies the same rounding
to the input of each matrix (x -> d * round(x / d), d = max|x| / 127 per block) and runs in
float64, so what is left is TensorFold's float32 arithmetic; see the bound in
test_mixed_logits_match_transformers.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold import _core  # noqa: E402
from tensorfold.convert import convert  # noqa: E402

from test_hf_parity import PROMPTS, _tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
# Activation block of each weight type (llama.cpp's vec_dot_type): 0 = float activations.
ACT_BLOCK = {Q.F32: 0, Q.F16: 0, Q.BF16: 0, Q.Q4_0: 32, Q.Q4_1: 32, Q.Q5_0: 32, Q.Q5_1: 32,
             Q.Q8_0: 32, Q.Q2_K: 256, Q.Q3_K: 256, Q.Q4_K: 256, Q.Q5_K: 256, Q.Q6_K: 256}

COMMON = dict(hidden_size=256, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              initializer_range=0.05)

# arch -> (config, model class, config extras, {tensor: type}); unnamed tensors stay F32.
# Per layer, q/k/v, gate/up and the experts' gate/up/down mix types and activation layouts
# (Q8_32 / Q8_256 / F32), and the reduction dimension of attn_output / ffn_down / the experts'
# down projection mixes 32- and 256-blocks over the layers.
MODELS = {
    # dense, untied, q/k norm; 8 heads over 2 KV heads of 64: TP splits attn_output at 256
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                   tie_word_embeddings=False),
              {"token_embd": Q.Q6_K, "output": Q.Q8_0,
               "blk.0.attn_q": Q.Q4_K, "blk.0.attn_k": Q.Q5_K, "blk.0.attn_v": Q.Q6_K, "blk.0.attn_output": Q.Q8_0,
               "blk.0.ffn_gate": Q.Q4_0, "blk.0.ffn_up": Q.Q8_0, "blk.0.ffn_down": Q.Q6_K,
               "blk.1.attn_q": Q.Q8_0, "blk.1.attn_k": Q.Q4_1, "blk.1.attn_v": Q.F16, "blk.1.attn_output": Q.Q4_K,
               "blk.1.ffn_gate": Q.Q3_K, "blk.1.ffn_up": Q.BF16, "blk.1.ffn_down": Q.Q5_0}),
    # dense, tied embedding/output in Q6_K, q/k/v biases
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, tie_word_embeddings=True),
              {"token_embd": Q.Q6_K,
               "blk.0.attn_q": Q.Q2_K, "blk.0.attn_k": Q.Q4_0, "blk.0.attn_v": Q.Q8_0, "blk.0.attn_output": Q.Q5_K,
               "blk.0.ffn_gate": Q.Q6_K, "blk.0.ffn_up": Q.Q4_K, "blk.0.ffn_down": Q.Q8_0,
               "blk.1.attn_q": Q.Q5_1, "blk.1.attn_k": Q.Q5_K, "blk.1.attn_v": Q.Q6_K, "blk.1.attn_output": Q.Q4_0,
               "blk.1.ffn_gate": Q.Q8_0, "blk.1.ffn_up": Q.Q2_K, "blk.1.ffn_down": Q.Q3_K}),
    # MoE, F16 embedding, expert types changing per layer; expert width 512 splits at 256
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                      moe_intermediate_size=512, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
                 {"token_embd": Q.F16, "output": Q.Q5_K,
                  "blk.0.attn_q": Q.Q8_0, "blk.0.attn_k": Q.Q8_0, "blk.0.attn_v": Q.Q6_K, "blk.0.attn_output": Q.Q4_K,
                  "blk.0.ffn_gate_exps": Q.Q4_K, "blk.0.ffn_up_exps": Q.Q8_0, "blk.0.ffn_down_exps": Q.Q6_K,
                  "blk.1.attn_q": Q.Q4_K, "blk.1.attn_k": Q.Q4_K, "blk.1.attn_v": Q.Q5_0, "blk.1.attn_output": Q.Q8_0,
                  "blk.1.ffn_gate_exps": Q.Q5_0, "blk.1.ffn_up_exps": Q.Q3_K, "blk.1.ffn_down_exps": Q.Q4_0}),
    # MoE with a gated shared expert, Q4_K embedding
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=512, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
                 {"token_embd": Q.Q4_K, "output": Q.Q6_K,
                  "blk.0.attn_q": Q.Q4_0, "blk.0.attn_k": Q.Q4_0, "blk.0.attn_v": Q.Q8_0, "blk.0.attn_output": Q.Q4_0,
                  "blk.0.ffn_gate_exps": Q.Q2_K, "blk.0.ffn_up_exps": Q.Q4_1, "blk.0.ffn_down_exps": Q.Q8_0,
                  "blk.0.ffn_gate_shexp": Q.Q5_K, "blk.0.ffn_up_shexp": Q.Q8_0, "blk.0.ffn_down_shexp": Q.Q6_K,
                  "blk.1.attn_q": Q.Q5_K, "blk.1.attn_k": Q.Q5_K, "blk.1.attn_v": Q.Q6_K, "blk.1.attn_output": Q.Q5_K,
                  "blk.1.ffn_gate_exps": Q.BF16, "blk.1.ffn_up_exps": Q.Q6_K, "blk.1.ffn_down_exps": Q.Q4_K,
                  "blk.1.ffn_gate_shexp": Q.Q4_0, "blk.1.ffn_up_shexp": Q.F16, "blk.1.ffn_down_shexp": Q.Q5_1}),
}

# GGUF tensor (without blk.N. and .weight) -> (HF module under model.layers.N, expert slice)
_LAYER = {"attn_q": ("self_attn.q_proj", None), "attn_k": ("self_attn.k_proj", None),
          "attn_v": ("self_attn.v_proj", None), "attn_output": ("self_attn.o_proj", None),
          "ffn_gate": ("mlp.gate_proj", None), "ffn_up": ("mlp.up_proj", None), "ffn_down": ("mlp.down_proj", None),
          "ffn_gate_exps": ("mlp.experts.gate_up_proj", "gate"), "ffn_up_exps": ("mlp.experts.gate_up_proj", "up"),
          "ffn_down_exps": ("mlp.experts.down_proj", None),
          "ffn_gate_shexp": ("mlp.shared_expert.gate_proj", None), "ffn_up_shexp": ("mlp.shared_expert.up_proj", None),
          "ffn_down_shexp": ("mlp.shared_expert.down_proj", None)}


def _hf_param(model, tensor: str):
    """The transformers parameter (as a view) that holds a GGUF weight tensor."""
    if tensor == "token_embd":
        return model.model.embed_tokens.weight
    if tensor == "output":
        return model.lm_head.weight
    _, n, role = tensor.split(".")
    layer = model.model.layers[int(n)]
    module, part = _LAYER[role]
    if "experts" in module:  # fused [n_expert, rows, k] tensors; gate and up share one
        w = layer.get_parameter(module)
        half = w.shape[1] // 2
        return w[:, :half] if part == "gate" else w[:, half:] if part == "up" else w
    return layer.get_submodule(module).weight


def quantize(a: np.ndarray, t) -> np.ndarray:
    """Bytes of a float32 array (rows along the last axis) in type t, shaped like the gguf
    package's quantized arrays. The gguf package quantizes the float and legacy types; it
    only dequantizes K-quants, so those bytes come from TensorFold's reference quantizer (the
    oracle still reads them back with the gguf package)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if ACT_BLOCK[t] != 256:
        return gguf.quants.quantize(a, t)
    return np.asarray(_core.quantize(int(t), a.reshape(-1))).reshape(*a.shape[:-1], -1)


def rewrite(src: str, dst: str, plan: dict) -> dict:
    """Copy the GGUF at src to dst with the tensors of `plan` in their types; returns the
    gguf package's dequantization of each of them (numpy layout)."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    deq = {}
    for t in reader.tensors:
        data = np.array(t.data)
        shape = list(reversed([int(d) for d in t.shape]))
        key = t.name.removesuffix(".weight")
        if key in plan:
            assert t.tensor_type == Q.F32
            qt = plan[key]
            q = quantize(data.reshape(shape), qt)
            deq[key] = gguf.quants.dequantize(q, qt).reshape(shape)
            w.add_tensor(t.name, q, raw_dtype=qt)  # shape from the bytes per row
        else:
            w.add_tensor(t.name, data, raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert set(deq) == set(plan), f"plan names tensors the file lacks: {set(plan) - set(deq)}"
    return deq


def _q8(x: "torch.Tensor", block: int) -> "torch.Tensor":
    """8-bit symmetric rounding per block of the last axis: d = max|x| / 127, x -> d * rne(x / d)."""
    if not block:
        return x
    s = x.shape
    xb = x.reshape(*s[:-1], s[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127.0)).reshape(s).to(x.dtype)


def _experts_forward(blocks):
    """transformers' fused-experts forward with each projection's input rounded as above."""
    bg, bu, bd = blocks

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        half = self.gate_up_proj.shape[1] // 2
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if len(tok) == 0:
                continue
            x = hidden_states[tok]
            g = torch.nn.functional.linear(_q8(x, bg), self.gate_up_proj[e, :half])
            u = torch.nn.functional.linear(_q8(x, bu), self.gate_up_proj[e, half:])
            y = torch.nn.functional.linear(_q8(self.act_fn(g) * u, bd), self.down_proj[e])
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
        return out
    return forward


@pytest.fixture(scope="module", params=sorted(MODELS))
def mixed(request, tmp_path_factory):
    """(arch, mixed GGUF path, transformers model (float64) with the dequantized weights, plan)."""
    arch = request.param
    cfg_name, cls_name, extra, plan = MODELS[arch]
    d = tmp_path_factory.mktemp("mixed-" + arch)
    vocab = _tokenizer(d)
    torch.manual_seed(4321)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, **COMMON, **extra)
    model = getattr(transformers, cls_name)(cfg).eval()
    model.config.eos_token_id = vocab - 1
    with torch.no_grad():
        # Norm weights of 1 (the init) keep quantized embedding rows on the block grid after
        # RMSNorm, so x / d lands exactly on .5 for many elements and the rounding ties on
        # last-bit differences; any other weights make that improbable.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    model.save_pretrained(d, safe_serialization=True)
    f32 = d / "model-f32.gguf"
    convert(str(d), str(f32), "f32", progress=False)
    path = d / "model-mixed.gguf"
    deq = rewrite(str(f32), str(path), plan)
    f32_tensors = {t.name.removesuffix(".weight"): np.array(t.data) for t in gguf.GGUFReader(str(f32)).tensors}
    with torch.no_grad():
        for key, values in deq.items():
            p = _hf_param(model, key)
            # the name map is right: the F32 file holds exactly this parameter
            assert np.array_equal(f32_tensors[key].reshape(p.shape), p.numpy()), key
            p.copy_(torch.from_numpy(values.reshape(p.shape)))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # the grouped-matmul path has no float64
    return arch, str(path), model.double(), plan


def _logits(model, plan, ids, emulate: bool):
    """transformers logits; with emulate, each weight's input rounded for its type."""
    hooks, patched = [], []
    if emulate:
        def pre(block):
            return lambda m, args: (_q8(args[0], block),) + tuple(args[1:])
        tied = model.config.tie_word_embeddings
        head = plan.get("token_embd" if tied else "output", Q.F32)
        hooks.append(model.lm_head.register_forward_pre_hook(pre(ACT_BLOCK[head])))
        for i, layer in enumerate(model.model.layers):
            for role, (module, part) in _LAYER.items():
                t = plan.get(f"blk.{i}.{role}")
                if t is None or "experts" in module:
                    continue
                hooks.append(layer.get_submodule(module).register_forward_pre_hook(pre(ACT_BLOCK[t])))
            if f"blk.{i}.ffn_gate_exps" in plan:
                ex = layer.mlp.experts
                blocks = [ACT_BLOCK[plan[f"blk.{i}.ffn_{r}_exps"]] for r in ("gate", "up", "down")]
                ex.forward = types.MethodType(_experts_forward(blocks), ex)
                patched.append(ex)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].double().numpy()
    finally:
        for h in hooks:
            h.remove()
        for ex in patched:
            del ex.forward


def test_mixed_file_has_the_planned_types(mixed):
    arch, path, _, plan = mixed
    types_in_file = {t["name"].removesuffix(".weight"): t["type"] for t in _core.GgufFile(path).tensors()}
    for key, t in plan.items():
        assert types_in_file[key] == t.name, key


def test_mixed_logits_match_transformers(mixed):
    """Bound. Against the emulating float64 oracle, TensorFold's float32 sums differ by ~1e-6
    relative, except where such a difference moves x / d across a rounding boundary (.5): that
    element then differs by one step d = max|x| / 127, which shifts the logits by up to ~1% of
    their range at that position and, through attention, after it (a float32 transformers run
    of the same oracle shows such flips too). So: mean |diff| <= 1e-3 x the logit range and
    max |diff| <= 2e-2 x range (a few flips); a weight given the wrong activations (buffer,
    layout, stride) is off by the order of the range itself. Against plain transformers (no
    rounding), the distance must be about the rounding's own effect."""
    arch, path, model, plan = mixed
    eng = tensorfold.Engine(path, threads=2, kv_type="f32", context=256)
    for ids in PROMPTS:
        ours = eng.logits(ids)
        emu = _logits(model, plan, ids, emulate=True)
        plain = _logits(model, plan, ids, emulate=False)
        assert ours.shape == emu.shape
        span = float(plain.max() - plain.min())
        diff = np.abs(ours - emu)
        rounding = float(np.abs(plain - emu).max())
        assert float(diff.mean()) <= 1e-3 * span, f"{arch}: mean |ours - oracle| {diff.mean():.3g}, range {span:.3g}"
        assert float(diff.max()) <= 2e-2 * span, f"{arch}: max |ours - oracle| {diff.max():.3g}, range {span:.3g}"
        assert float(np.abs(ours - plain).max()) <= rounding + 2e-2 * span
        # top-1: the oracle's logit of our choice is its best, up to a near-tie within the bound
        chosen = emu[np.arange(len(ids)), ours.argmax(-1)]
        assert np.all(chosen >= emu.max(-1) - 2e-2 * span)


def test_mixed_greedy_decode_matches_transformers(mixed):
    """Decode (one token per step, one row per matmul): every greedily chosen token is the
    emulated oracle's argmax at that position, up to a near-tie within the max bound above."""
    arch, path, model, plan = mixed
    eng = tensorfold.Engine(path, threads=2, kv_type="f32", context=256)
    ids = list(PROMPTS[1])
    out = eng.generate(ids, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    emu = _logits(model, plan, ids + out, emulate=True)
    span = float(emu.max() - emu.min())
    for i, tok in enumerate(out):
        row = emu[len(ids) - 1 + i]
        assert row[tok] >= row.max() - 2e-2 * span, f"{arch}: step {i} chose {tok}, oracle {int(row.argmax())}"


def test_tp2_equals_tp1_on_mixed_model(mixed):
    """TP=2 (two processes) gives TP=1's logits and tokens bit for bit on a mixed model whose
    split reductions cut 32- and 256-element blocks (attn_output Q8_0 / Q4_K, expert down
    Q6_K / Q4_0: the split lands at 256, a boundary of both)."""
    arch, path, _, _ = mixed
    if arch not in ("qwen3", "qwen3moe"):
        pytest.skip("TP is checked on the qwen3 and qwen3moe mixes")
    from test_tp import Pair

    ids = [5, 17, 3, 250, 9, 33, 101, 7]
    solo = tensorfold.Engine(path, threads=1, context=256, tp_compatible=True)
    ref_logits = solo.logits(ids)
    ref_tokens = solo.generate(ids, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    pair = Pair(path)
    try:
        assert np.array_equal(pair.engine.logits(ids), ref_logits)
        assert pair.engine.generate(ids, max_tokens=16, temperature=0, ignore_eos=True).token_ids == ref_tokens
    finally:
        err = pair.close()
    assert pair.worker.returncode == 0, err


def test_weight_type_without_kernels_is_refused_by_name(tmp_path, mixed):
    """The only refusals left are real ones: a type with no kernels names the tensor and the
    traits table's list of supported types."""
    arch, path, _, _ = mixed
    if arch != "qwen3":
        pytest.skip("one model is enough")
    reader = gguf.GGUFReader(path)
    dst = tmp_path / "q8k.gguf"
    w = gguf.GGUFWriter(str(dst), "qwen3")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        w.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = list(reversed([int(d) for d in t.shape]))
        if t.name == "blk.1.attn_k.weight":  # Q8_K: an activation format, not a weight type
            rows, k = shape
            w.add_tensor(t.name, np.zeros((rows, k // 256 * 292), np.uint8), raw_dtype=Q.Q8_K)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises((ValueError, RuntimeError), match=r"blk\.1\.attn_k\.weight.*Q8_K.*Q4_K"):
        tensorfold.Engine(str(dst), threads=1, context=64)
