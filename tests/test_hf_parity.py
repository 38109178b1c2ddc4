"""Logit, greedy and routing parity with Hugging Face transformers on tiny random models of
every supported architecture: build the model in the test (no downloads), save it, convert
it with `tensorfold convert`, and compare TensorFold with transformers (CPU torch)."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold.convert import convert  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x * 2\n",
         "Mixture of experts routes tokens.", "1234567890 3.14159", "<|im_start|>user\nhi<|im_end|>"]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Odd sizes on purpose: hidden 72, 6 heads over 3 KV heads, 5 experts top-2, expert width 36.
COMMON = dict(hidden_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.08)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=100, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=100, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=100, head_dim=16, tie_word_embeddings=False)),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(intermediate_size=100, moe_intermediate_size=36, num_experts=5, num_experts_per_tok=2,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], head_dim=16,
                      tie_word_embeddings=False)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(intermediate_size=100, moe_intermediate_size=36, shared_expert_intermediate_size=48,
                      num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[], tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=36, num_local_experts=5, num_experts_per_tok=2, tie_word_embeddings=False)),
    # YaRN beyond a 16-token trained context (the 23-token prompt crosses it): transformers'
    # defaults (beta 32/1, attention factor 0.1 ln 4 + 1), and explicit betas and attention factor
    "llama-yarn": ("LlamaConfig", "LlamaForCausalLM",
                   dict(intermediate_size=100, tie_word_embeddings=False, max_position_embeddings=64,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                             original_max_position_embeddings=16))),
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(intermediate_size=100, head_dim=16, tie_word_embeddings=False, max_position_embeddings=128,
                        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=8.0,
                                             original_max_position_embeddings=16, beta_fast=16.0, beta_slow=2.0,
                                             attention_factor=1.3))),
    # sliding-window attention (the Swa kind): every layer reads its last 8 positions, so the
    # 23-token prompt and the greedy continuation run far past the window
    "mistral-swa": ("MistralConfig", "MistralForCausalLM",
                    dict(intermediate_size=100, tie_word_embeddings=False, sliding_window=8)),
    # a window on some layers only (transformers' layer_types from max_window_layers): layer 0
    # full, layer 1 windowed, so the cache has two groups
    "qwen2-swa": ("Qwen2Config", "Qwen2ForCausalLM",
                  dict(intermediate_size=100, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8,
                       max_window_layers=1)),
}
SWA = {"mistral-swa", "qwen2-swa"}
MOE = {"qwen3moe", "qwen2moe", "mixtral"}
PROMPTS = [[5], [17, 3, 250, 9, 33, 101, 7], list(range(40, 63))]


def _tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT}))
    return tok.get_vocab_size()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hf_model(request, tmp_path_factory):
    arch = request.param
    cfg_name, cls_name, extra = ARCHS[arch]
    d = tmp_path_factory.mktemp(arch)
    vocab = _tokenizer(d)
    torch.manual_seed(1234)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, **{**COMMON, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    model.config.eos_token_id = vocab - 1
    model.save_pretrained(d, safe_serialization=True)
    return arch, d, model


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    arch, d, model = hf_model
    out = {}
    for outtype in ("f32", "f16"):
        path = tmp_path_factory.mktemp(arch + "-gguf") / f"model-{outtype}.gguf"
        convert(str(d), str(path), outtype, progress=False)
        out[outtype] = str(path)
    return out


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("outtype,tol", [("f32", 1e-4), ("f16", 1e-2)])
def test_logits_match_transformers(hf_model, converted, outtype, tol):
    arch, _, model = hf_model
    eng = tensorfold.Engine(converted[outtype], threads=2, kv_type="f32", context=256)
    for ids in PROMPTS:
        ref = _hf_logits(model, ids)
        ours = eng.logits(ids)
        assert ours.shape == ref.shape
        span = float(ref.max() - ref.min())
        err = float(np.abs(ours - ref).max())
        assert err <= tol * span, f"{arch}/{outtype}: max |diff| {err:.3g} > {tol} x logit range {span:.3g}"


def test_greedy_continuation_matches_transformers(hf_model, converted):
    arch, _, model = hf_model
    eng = tensorfold.Engine(converted["f32"], threads=2, kv_type="f32", context=256)
    ids = list(PROMPTS[1])
    ref = []
    with torch.no_grad():
        for _ in range(32):
            nxt = int(model(torch.tensor([ids + ref])).logits[0, -1].argmax())
            ref.append(nxt)
    out = eng.generate(ids, max_tokens=32, temperature=0, ignore_eos=True)
    assert out.token_ids == ref


def test_selected_experts_match_transformers(hf_model, converted):
    arch, _, model = hf_model
    if arch not in MOE:
        pytest.skip("dense architecture")
    eng = tensorfold.Engine(converted["f32"], threads=2, kv_type="f32", context=256)
    captured = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: captured.append(o[2].clone()))
             for layer in model.model.layers]
    ids = PROMPTS[2]
    try:
        _hf_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    ours = eng.routing(ids)
    k = model.config.num_experts_per_tok
    for layer, (hf_sel, our_sel) in enumerate(zip(captured, ours)):
        hf_sets = [set(r) for r in hf_sel.reshape(len(ids), k).tolist()]
        our_sets = [set(r) for r in np.array(our_sel).reshape(len(ids), k).tolist()]
        assert our_sets == hf_sets, f"{arch} layer {layer}: experts differ"
    usage = eng.stats()["expert_usage"]
    assert len(usage) == model.config.num_hidden_layers and all(sum(u) > 0 for u in usage)


def _rewrite_with_alignment(src: str, dst: str, alignment: int) -> None:
    """Copy a GGUF with another general.alignment, padding the metadata until some float
    tensor's data lands on an address that is not a multiple of 4."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    for pad in range(8):
        w = gguf.GGUFWriter(dst, arch)
        w.add_custom_alignment(alignment)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
        w.add_string("test.pad", "x" * pad)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                         raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out = gguf.GGUFReader(dst)
        if any(t.data_offset % 4 for t in out.tensors if t.tensor_type == gguf.GGMLQuantizationType.F32):
            return
    raise AssertionError("could not produce misaligned tensor data")


def test_unaligned_tensor_data_matches_transformers(hf_model, converted, tmp_path):
    # general.alignment = 1 is legal GGUF: float tensors (norms too) may then start at odd
    # addresses. The model must load and compute exactly as transformers does.
    arch, _, model = hf_model
    if arch != "llama":
        pytest.skip("one architecture is enough for the data layout")
    path = str(tmp_path / "unaligned.gguf")
    _rewrite_with_alignment(converted["f32"], path, 1)
    eng = tensorfold.Engine(path, threads=2, kv_type="f32", context=256)
    for ids in PROMPTS:
        ref = _hf_logits(model, ids)
        ours = eng.logits(ids)
        span = float(ref.max() - ref.min())
        assert float(np.abs(ours - ref).max()) <= 1e-4 * span


def test_sliding_window_over_many_blocks_matches_transformers(hf_model, converted):
    # A window of 8 over a 150-token sequence: the cache lets go of the 16-token blocks behind
    # the window as the sequence moves on (prefill in several batches, then decode), and every
    # position's logits still match transformers' masked attention.
    arch, _, model = hf_model
    if arch not in SWA:
        pytest.skip("the sliding-window models")
    ids = [(7 * i + 3) % (model.config.vocab_size - 1) for i in range(150)]
    eng = tensorfold.Engine(converted["f32"], threads=2, kv_type="f32", context=256, max_batch_tokens=32)
    ref = _hf_logits(model, ids)
    ours = eng.logits(ids)
    span = float(ref.max() - ref.min())
    assert float(np.abs(ours - ref).max()) <= 1e-4 * span
    with torch.no_grad():
        nxt = [int(model(torch.tensor([ids[:100] + []])).logits[0, -1].argmax())]
        for _ in range(40):
            nxt.append(int(model(torch.tensor([ids[:100] + nxt])).logits[0, -1].argmax()))
    out = eng.generate(ids[:100], max_tokens=41, temperature=0, ignore_eos=True)
    assert out.token_ids == nxt


def test_every_backend_matches_transformers(hf_model, converted):
    # The engine on each backend this machine has (tensorfold.available_backends()).
    arch, _, model = hf_model
    if arch not in ("llama", "qwen3moe"):
        pytest.skip("one dense and one MoE architecture are enough per backend")
    for backend in tensorfold.available_backends():
        eng = tensorfold.Engine(converted["f32"], threads=2, kv_type="f32", context=256, backend=backend)
        assert eng.backend == backend
        for ids in PROMPTS:
            ref = _hf_logits(model, ids)
            span = float(ref.max() - ref.min())
            err = float(np.abs(eng.logits(ids) - ref).max())
            assert err <= 1e-4 * span, f"{backend}: max |diff| {err:.3g} > 1e-4 x logit range {span:.3g}"
        eng.close()


def test_kv_groups_in_the_memory_plan(hf_model, converted):
    # One pool group per KV spec, each sized from first principles: layers x heads x (K + V)
    # values x element size per token, over whole 16-token blocks of the pool.
    arch, _, model = hf_model
    if arch not in ("llama", "qwen2-swa"):
        pytest.skip("one model with one group, one with two")
    cfg = model.config
    eng = tensorfold.Engine(converted["f32"], threads=1, kv_type="f16", context=256, kv_tokens=1000,
                            prefix_cache=False)
    plan = eng.memory_plan
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_layer = 1008 * cfg.num_key_value_heads * 2 * head_dim * 2  # 63 blocks of 16 tokens, f16
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    groups = sorted(set(layer_types), key=layer_types.index)
    lines = [ln for ln in plan["table"].splitlines() if ln.strip().startswith("KV ")]
    assert len(lines) == len(groups), plan["table"]
    assert plan["kv"] == per_layer * cfg.num_hidden_layers
    if arch == "qwen2-swa":
        assert "window 8" in lines[1] and "window" not in lines[0], plan["table"]
