"""Model parity of the CUDA backend with the CPU backend (marker `gpu`; skipped with the reason
where TensorFold has no CUDA or the machine no device).

Models: SmolLM2-135M-Instruct (Q4_1, the embedded default model), a tiny random Qwen3-MoE
converted here (F32 and F16 products, routing, grouped expert products), and llama.cpp's
conversion of the DeepSeek-V2-Lite-shaped fixture (MLA latent attention, shared + routed experts).

Bound on the logits, derived from the CPU itself: CUDA computes attention in float32 and
accumulates products in another order, where the CPU (F16 cache) rounds q and the softmax
probabilities to half. So the CUDA logits may differ from the CPU's by about as much as the CPU's
own logits move when its cache precision changes (f16 vs f32): bound = 2 x that movement +
1e-4 x the logit range. Greedy tokens must agree up to a near-tie: the first differing step is
accepted only where the CPU's best two logits are closer than twice the bound (then the
continuations part, and comparison stops).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tensorfold
from tensorfold import _core

cuda = _core.cuda
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda.built_with_cuda(), reason=f"TensorFold was built without CUDA ({cuda.build_note()})"),
    pytest.mark.skipif(cuda.built_with_cuda() and cuda.device_count() == 0, reason="no CUDA device on this machine"),
]

FIXTURES = Path(__file__).parent / "fixtures"
PROMPTS = [[1, 2, 3], [17, 3, 250, 9, 33, 101, 7], list(range(40, 63))]


def _engine(path, backend, kv_type="f16"):
    return tensorfold.Engine(path, threads=2, kv_type=kv_type, context=512, backend=backend)


def _bound(path, ids):
    cpu16, cpu32 = _engine(path, "cpu"), _engine(path, "cpu", "f32")
    a, b = cpu16.logits(ids), cpu32.logits(ids)
    cpu16.close(), cpu32.close()
    span = float(a.max() - a.min())
    return a, 2.0 * float(np.abs(a - b).max()) + 1e-4 * span


def _check_model(path, prompts=PROMPTS, n_greedy=24):
    gpu = _engine(path, "cuda")
    assert gpu.backend == "cuda"
    for ids in prompts:
        ref, bound = _bound(path, ids)
        got = gpu.logits(ids)
        err = float(np.abs(got - ref).max())
        assert err <= bound, f"prompt of {len(ids)}: max |cuda - cpu| {err:.3g} > bound {bound:.3g}"
        cpu = _engine(path, "cpu")
        want = cpu.generate(ids, max_tokens=n_greedy, temperature=0, ignore_eos=True).token_ids
        have = gpu.generate(ids, max_tokens=n_greedy, temperature=0, ignore_eos=True).token_ids
        for i, (w, h) in enumerate(zip(want, have)):
            if w == h:
                continue
            lg = cpu.logits(list(ids) + list(want[:i]))[-1]
            top2 = np.sort(lg)[-2:]
            assert top2[1] - top2[0] <= 2 * bound, f"greedy step {i}: {h} != {w}, not a near-tie"
            break
        cpu.close()
    gpu.close()


def test_smollm2_q4_1(smollm2_path):
    _check_model(smollm2_path)


def test_deepseek2_mla_fixture():
    _check_model(str(FIXTURES / "deepseek2" / "v2lite" / "llamacpp-f32.gguf"))


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tensorfold.convert import convert

    d = tmp_path_factory.mktemp("qwen3moe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["Mixture of experts routes tokens to a few experts."] * 8,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    torch.manual_seed(7)
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      intermediate_size=256, moe_intermediate_size=256, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                      mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False,
                                      initializer_range=0.08)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(d, safe_serialization=True)
    out = {}
    for outtype in ("f32", "f16"):
        out[outtype] = str(d / f"model-{outtype}.gguf")
        convert(str(d), out[outtype], outtype, progress=False)
    return out


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_moe_fixture(moe_gguf, outtype):
    _check_model(moe_gguf[outtype])


def test_moe_routing_equal(moe_gguf):
    ids = list(range(30, 60))
    cpu, gpu = _engine(moe_gguf["f32"], "cpu", "f32"), _engine(moe_gguf["f32"], "cuda", "f32")
    a, b = cpu.routing(ids), gpu.routing(ids)
    cpu.close(), gpu.close()
    diff = sum(x != y for la, lb in zip(a, b) for x, y in zip(la, lb))
    assert diff <= len(ids) // 10, f"{diff} expert choices differ"


def test_quantized_formats_through_the_engine(moe_gguf, tmp_path):
    """The MoE fixture quantized by tensorfold quantize to a K-quant / IQ4 mix near 4.8 bits per
    weight: CUDA runs every format of the file (refusing none) and matches the CPU on it."""
    from tensorfold.quantize import quantize

    out = str(tmp_path / "moe-mix.gguf")
    quantize(moe_gguf["f32"], out, target_bpw=4.8, candidates=["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS"],
             threads=2, progress=False, echo=lambda *a, **k: None)
    _check_model(out, prompts=PROMPTS[1:], n_greedy=12)


def test_auto_picks_cuda_with_a_device(smollm2_path):
    eng = tensorfold.Engine(smollm2_path, threads=2, context=256, backend="auto")
    assert eng.backend == "cuda"
    eng.close()
