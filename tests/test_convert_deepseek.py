"""tensorfold convert for DeepSeek V2 / V3 (deepseek2, multi-head latent attention), checked
against llama.cpp's own converter.

tests/fixtures/deepseek2/NAME/hf is a tiny random Hugging Face checkpoint and
NAME/llamacpp-f32.gguf what llama.cpp's convert_hf_to_gguf.py made of it (both written by
tests/fixtures/deepseek2/make_deepseek2_fixtures.py, which CI never runs). Our f32 output must
have the same tensors (names, shapes, types, bytes) and the same deepseek2.* metadata.

Keys deliberately not compared with llama.cpp's file:
- general.name / general.type / general.size_label: naming only (llama.cpp derives them from the
  directory name and the parameter count; TensorFold writes the name alone);
- tokenizer.ggml.add_bos_token: TensorFold always writes it, llama.cpp only when
  tokenizer_config.json names it; the vocabulary keys themselves are compared;
- deepseek2.expert_gating_func where llama.cpp's file lacks it (config.json without
  scoring_func): TensorFold writes what the model does (V2 softmax, V3 sigmoid); llama.cpp's
  loader falls back to softmax then, the same thing for V2 (and wrong for V3).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")

from checkpoint_helpers import edited_checkpoint  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from tensorfold.convert import ConvertError, convert  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepseek2"
NAMES = ["v2lite", "v3"]
NOT_COMPARED = {"general.name", "general.type", "general.size_label", "tokenizer.ggml.add_bos_token"}

# What llama.cpp's converter wrote for the v3 fixture (the facts this converter reproduces).
LLAMA_CPP_V3_KV = {
    "deepseek2.vocab_size": 320,
    "deepseek2.context_length": 512,
    "deepseek2.embedding_length": 96,
    "deepseek2.block_count": 3,
    "deepseek2.feed_forward_length": 136,
    "deepseek2.attention.head_count": 5,
    "deepseek2.attention.head_count_kv": 1,
    "deepseek2.attention.layer_norm_rms_epsilon": np.float32(1e-6),
    "deepseek2.attention.q_lora_rank": 40,
    "deepseek2.attention.kv_lora_rank": 48,
    "deepseek2.attention.key_length": 64,        # kv_lora_rank + qk_rope_head_dim
    "deepseek2.attention.value_length": 48,      # kv_lora_rank
    "deepseek2.attention.key_length_mla": 40,    # qk_nope_head_dim + qk_rope_head_dim
    "deepseek2.attention.value_length_mla": 20,  # v_head_dim
    "deepseek2.rope.freq_base": 10000.0,
    "deepseek2.rope.dimension_count": 16,
    "deepseek2.rope.scaling.type": "yarn",
    "deepseek2.rope.scaling.factor": 4.0,
    "deepseek2.rope.scaling.original_context_length": 128,
    "deepseek2.rope.scaling.yarn_beta_fast": 32.0,
    "deepseek2.rope.scaling.yarn_beta_slow": 1.0,
    "deepseek2.rope.scaling.yarn_log_multiplier": np.float32(0.1),  # 0.1 * mscale_all_dim
    "deepseek2.leading_dense_block_count": 1,
    "deepseek2.expert_count": 16,
    "deepseek2.expert_used_count": 4,
    "deepseek2.expert_shared_count": 1,
    "deepseek2.expert_feed_forward_length": 40,
    "deepseek2.expert_weights_scale": 2.5,
    "deepseek2.expert_weights_norm": True,
    "deepseek2.expert_gating_func": 2,  # sigmoid
    "deepseek2.expert_group_count": 4,
    "deepseek2.expert_group_used_count": 2,
}


def _fixture_module():
    spec = importlib.util.spec_from_file_location("make_deepseek2_fixtures",
                                                  FIXTURES / "make_deepseek2_fixtures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kv(reader) -> dict:
    return {k: (f.contents(), [t for t in f.types]) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def _hf(name: str) -> Path:
    d = FIXTURES / name / "hf"
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"fixture {d} missing (run tests/fixtures/deepseek2/make_deepseek2_fixtures.py)")
    return d


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """name → our f32 conversion of the fixture (converted once per module)."""
    root = tmp_path_factory.mktemp("ds2")
    out = {}
    for name in NAMES:
        out[name] = convert(_hf(name), root / f"{name}.gguf", "f32", progress=False)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_matches_llama_cpp(ours, name):
    r_ours = gguf.GGUFReader(ours[name])
    r_ref = gguf.GGUFReader(FIXTURES / name / "llamacpp-f32.gguf")

    # tensors: same names, GGUF shapes, types and bytes
    t_ours, t_ref = _tensors(r_ours), _tensors(r_ref)
    assert sorted(t_ours) == sorted(t_ref)
    for tname, ref in t_ref.items():
        got = t_ours[tname]
        assert [int(x) for x in got.shape] == [int(x) for x in ref.shape], tname
        assert got.tensor_type == ref.tensor_type == Q.F32, tname
        assert np.array_equal(np.asarray(got.data), np.asarray(ref.data)), tname

    # metadata: every key llama.cpp wrote (deepseek2.*, tokenizer.*, general.*), same value and type
    kv_ours, kv_ref = _kv(r_ours), _kv(r_ref)
    assert kv_ref["general.architecture"][0] == "deepseek2"
    for key, (val, types) in kv_ref.items():
        if key in NOT_COMPARED:
            continue
        assert key in kv_ours, f"llama.cpp writes {key} = {val!r}, we do not"
        assert kv_ours[key][0] == val, (key, kv_ours[key][0], val)
        assert kv_ours[key][1] == types, (key, kv_ours[key][1], types)
    extra = sorted(k for k in kv_ours if k not in kv_ref and k not in NOT_COMPARED)
    if name == "v2lite":  # config.json has no scoring_func: llama.cpp leaves the gating out
        assert extra == ["deepseek2.expert_gating_func"]
        assert kv_ours["deepseek2.expert_gating_func"][0] == 1  # softmax, llama.cpp's fallback
    else:
        assert extra == []


def test_llama_cpp_v3_metadata_facts():
    r = gguf.GGUFReader(FIXTURES / "v3" / "llamacpp-f32.gguf")
    kv = {k: v for k, (v, _) in _kv(r).items() if k.startswith("deepseek2.")}
    assert kv == LLAMA_CPP_V3_KV


@pytest.mark.parametrize("name", NAMES)
def test_mla_layout_from_safetensors(ours, name):
    """Independent statement of the layouts: attn_k_b[h, c, d] = kv_b[h*(nope+v) + d, c],
    attn_v_b[h, d, c] = kv_b[h*(nope+v) + nope + d, c] (numpy order; GGUF ne reversed)."""
    from safetensors.numpy import load_file

    cfg = json.loads((_hf(name) / "config.json").read_text())
    nh, nope, vd, kv = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    st = load_file(str(_hf(name) / "model.safetensors"))
    t = _tensors(gguf.GGUFReader(ours[name]))
    for i in range(cfg["num_hidden_layers"]):
        kv_b = st[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        k_b, v_b = np.asarray(t[f"blk.{i}.attn_k_b.weight"].data), np.asarray(t[f"blk.{i}.attn_v_b.weight"].data)
        assert [int(x) for x in t[f"blk.{i}.attn_k_b.weight"].shape] == [nope, kv, nh]
        assert [int(x) for x in t[f"blk.{i}.attn_v_b.weight"].shape] == [kv, vd, nh]
        for h in range(nh):
            base = h * (nope + vd)
            np.testing.assert_array_equal(k_b[h], kv_b[base:base + nope].T)
            np.testing.assert_array_equal(v_b[h], kv_b[base + nope:base + nope + vd])


def test_q8_0_types_and_values(tmp_path):
    """q8_0: 1-D tensors and the router stay F32; rows that are not a multiple of 32
    (attn_k_b's 24, attn_v_b's 48, ...) fall back to F16, as llama.cpp does."""
    ref = _tensors(gguf.GGUFReader(FIXTURES / "v3" / "llamacpp-f32.gguf"))
    got = _tensors(gguf.GGUFReader(convert(_hf("v3"), tmp_path / "q8.gguf", "q8_0", progress=False)))
    assert sorted(got) == sorted(ref)
    for name, t in got.items():
        want = np.asarray(ref[name].data, dtype=np.float32)
        if want.ndim == 1 or "ffn_gate_inp" in name:
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data), want, err_msg=name)
        elif want.shape[-1] % 32 == 0:
            assert t.tensor_type == Q.Q8_0, name
            np.testing.assert_array_equal(dequantize(t.data, Q.Q8_0),
                                          dequantize(quantize(want, Q.Q8_0), Q.Q8_0), err_msg=name)
        else:
            assert t.tensor_type == Q.F16, name
            np.testing.assert_array_equal(np.asarray(t.data), want.astype(np.float16), err_msg=name)
    assert got["blk.1.attn_k_b.weight"].tensor_type == Q.F16
    assert got["blk.1.ffn_gate_exps.weight"].tensor_type == Q.Q8_0


def test_rope_interleave_false_is_reordered(tmp_path):
    """V3 with rope_interleave=false rotates halves; after conversion the GGUF rope rows must be
    the adjacent-pair layout. Checked end to end with transformers itself: the interleave=false
    model and an interleave=true model holding the converted q_b / kv_a weights give the same
    logits (llama.cpp's NORM rope is the interleaved rotation)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fx = _fixture_module()
    d = tmp_path / "hf"
    model = fx.save_hf("v3", d, rope_interleave=False)
    assert json.loads((d / "config.json").read_text())["rope_interleave"] is False
    t = _tensors(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f32", progress=False)))

    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    twin = fx.make_model("v3", rope_interleave=True)
    nope, rope, kv = 24, 16, 48
    for i in range(3):
        at = f"model.layers.{i}.self_attn"
        q_b = np.asarray(t[f"blk.{i}.attn_q_b.weight"].data)
        kv_a = np.asarray(t[f"blk.{i}.attn_kv_a_mqa.weight"].data)
        hf_q, hf_kv = sd[f"{at}.q_b_proj.weight"].numpy(), sd[f"{at}.kv_a_proj_with_mqa.weight"].numpy()
        # non-rope rows untouched, rope rows: GGUF start + 2i + j = HF start + j*rope/2 + i
        np.testing.assert_array_equal(kv_a[:kv], hf_kv[:kv])
        for h in range(5):
            s = h * (nope + rope)
            np.testing.assert_array_equal(q_b[s:s + nope], hf_q[s:s + nope])
            for r in range(rope // 2):
                for j in range(2):
                    np.testing.assert_array_equal(q_b[s + nope + 2 * r + j], hf_q[s + nope + j * rope // 2 + r])
        for r in range(rope // 2):
            for j in range(2):
                np.testing.assert_array_equal(kv_a[kv + 2 * r + j], hf_kv[kv + j * rope // 2 + r])
        sd[f"{at}.q_b_proj.weight"] = torch.from_numpy(q_b.copy())
        sd[f"{at}.kv_a_proj_with_mqa.weight"] = torch.from_numpy(kv_a.copy())
    twin.load_state_dict(sd)
    ids = torch.tensor([[5, 77, 123, 9, 250, 31, 64, 2]])
    with torch.no_grad():
        want = model(ids).logits
        got = twin(ids).logits
        unpermuted = fx.make_model("v3", rope_interleave=True)
        unpermuted.load_state_dict(model.state_dict())
        wrong = unpermuted(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (wrong - want).abs().max() > 1e-2  # the reordering matters for this model


def test_no_scoring_func_writes_the_model_gating(tmp_path):
    """config.json without scoring_func / topk_method (transformers' own DeepseekV3Config has no
    such fields): V3 routers are sigmoid, so expert_gating_func says so."""
    d = edited_checkpoint(_hf("v3"), tmp_path / "m", drop=("scoring_func", "topk_method"))
    kv = _kv(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f32", progress=False)))
    assert kv["deepseek2.expert_gating_func"][0] == 2


@pytest.mark.parametrize("name,update,groups", [
    # topk_group == n_group selects every group: nothing to write (llama.cpp's loader insists on used < count)
    ("v3", {"topk_group": 4}, None),
    ("v3", {"n_group": 1, "topk_group": 1}, (1, 1)),
    # V2 greedy ignores groups: n_group > 1 is left out (llama.cpp's converter would write it, and its
    # runtime would then route by groups); DeepSeek-V2-Lite's own 1 / 1 is written like llama.cpp does
    ("v2lite", {"n_group": 4, "topk_group": 2}, None),
    ("v2lite", {"n_group": 1, "topk_group": 1}, (1, 1)),
    ("v2lite", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 4}, None),
])
def test_expert_groups(tmp_path, name, update, groups):
    d = edited_checkpoint(_hf(name), tmp_path / "m", update)
    kv = _kv(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f32", progress=False)))
    got = (kv["deepseek2.expert_group_count"][0], kv["deepseek2.expert_group_used_count"][0]) \
        if "deepseek2.expert_group_count" in kv else None
    assert got == groups
    assert ("deepseek2.expert_group_used_count" in kv) == (groups is not None)


def test_mtp_layers_kept_or_dropped(tmp_path):
    """DeepSeek-V3 checkpoints append multi-token-prediction layers (model.layers.N, N >=
    num_hidden_layers). Kept by default as llama.cpp's nextn layer (a whole one is converted in
    tests/test_speculative.py); an incomplete one is refused naming what is missing; mtp=False
    (--no-mtp) drops it as llama.cpp's V3 converter does: the output is then llama.cpp's."""
    from safetensors.numpy import load_file, save_file

    src = _hf("v3")
    d = edited_checkpoint(src, tmp_path / "m")
    st = load_file(str(src / "model.safetensors"))
    st["model.layers.3.eh_proj.weight"] = np.ones((96, 192), np.float32)
    st["model.layers.3.self_attn.kv_b_proj.weight"] = np.ones((220, 48), np.float32)
    (d / "model.safetensors").unlink()
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"model\.layers\.3\."):
        convert(d, tmp_path / "full.gguf", "f32", progress=False)
    got = _tensors(gguf.GGUFReader(convert(d, tmp_path / "o.gguf", "f32", progress=False, mtp=False)))
    ref = _tensors(gguf.GGUFReader(FIXTURES / "v3" / "llamacpp-f32.gguf"))
    assert sorted(got) == sorted(ref)


@pytest.mark.parametrize("name,update,match", [
    ("v3", {"moe_layer_freq": 2}, "moe_layer_freq = 2"),
    ("v2lite", {"moe_layer_freq": 2}, "moe_layer_freq"),
    ("v3", {"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported.*sigmoid"),
    ("v2lite", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' is not supported.*softmax"),
    ("v3", {"topk_method": "greedy"}, "topk_method 'greedy'.*noaux_tc"),
    ("v2lite", {"topk_method": "mystery"}, "topk_method 'mystery'"),
    ("v2lite", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2},
     "group_limited_greedy.*cannot be represented"),
    ("v3", {"n_group": 5}, "cannot be split into n_group 5"),
    ("v3", {"n_group": None}, "n_group = None is not an integer >= 1"),
    ("v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": 128, "mscale": 0.7,
                                "mscale_all_dim": 1.0}}, "mscale = 0.7 and mscale_all_dim = 1.0"),
    ("v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                "original_max_position_embeddings": 128}}, "mscale = None"),
    ("v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "attention_factor": 1.2,
                                "original_max_position_embeddings": 128, "mscale": 1.0,
                                "mscale_all_dim": 1.0}}, "attention_factor"),
    ("v3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "only yarn"),
    ("v3", {"num_key_value_heads": 1}, "num_key_value_heads 1 != num_attention_heads 5"),
    ("v3", {"q_lora_rank": None}, "q_a_proj.weight present"),
    ("v2lite", {"q_lora_rank": 40}, "q_proj.weight present"),
    ("v3", {"attention_bias": True}, "attention_bias"),
    ("v3", {"rope_interleave": "yes"}, "rope_interleave"),
    ("v3", {"kv_lora_rank": 32}, "kv_a_proj_with_mqa.weight has shape"),
    ("v2lite", {"first_k_dense_replace": 0}, "mlp.gate.weight is missing"),
    ("v3", {"first_k_dense_replace": 9}, "first_k_dense_replace 9 > num_hidden_layers 3"),
    ("v3", {"architectures": ["DeepseekV2ForCausalLM"]}, "scoring_func 'sigmoid'"),
])
def test_refused(tmp_path, name, update, match):
    d = edited_checkpoint(_hf(name), tmp_path / "m", update)
    with pytest.raises(ConvertError, match=match):
        convert(d, tmp_path / "x.gguf", "f32", progress=False)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()


def test_v2_correction_bias_is_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    src = _hf("v2lite")
    d = edited_checkpoint(src, tmp_path / "m")
    st = load_file(str(src / "model.safetensors"))
    st["model.layers.1.mlp.gate.e_score_correction_bias"] = np.zeros(12, np.float32)
    (d / "model.safetensors").unlink()
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(ConvertError, match="e_score_correction_bias present"):
        convert(d, tmp_path / "x.gguf", "f32", progress=False)


def test_fixture_configs_round_trip():
    """The fixtures' config.json hold what the generator's CONFIGS say (shapes, YaRN)."""
    fx = _fixture_module()
    for name in NAMES:
        cfg = json.loads((_hf(name) / "config.json").read_text())
        for k, v in fx.build(name).items():
            if k == "rope_parameters":
                assert {kk: cfg[k][kk] for kk in v} == v
            else:
                assert cfg[k] == v, (name, k)


@pytest.mark.parametrize("name,interleave", [("v2lite", None), ("v3", None), ("v3", False)])
def test_llama_cpp_runs_our_gguf(tmp_path, ours, name, interleave):
    """When llama-cpp-python is installed: llama.cpp itself, running our GGUF, reproduces the
    transformers logits (F32 KV cache; with llama.cpp's default F16 cache a near-tie in the
    V3 router can flip one expert). The v2lite file needs attention.q_lora_rank = 0 as an
    override: llama.cpp's loader demands the key unless n_layer is 26/27 (DeepSeek-V2-Lite's
    sizes), while its converter, like ours, writes it only for q-LoRA models."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    llama_cpp = pytest.importorskip("llama_cpp")
    fx = _fixture_module()
    if interleave is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(_hf(name), dtype=torch.float32).eval()
        path = ours[name]
    else:
        model = fx.save_hf(name, tmp_path / "hf", rope_interleave=interleave)
        path = convert(tmp_path / "hf", tmp_path / "o.gguf", "f32", progress=False)
    ids = [5, 77, 123, 9, 250, 31, 64, 2, 100, 200]
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    over = {"deepseek2.attention.q_lora_rank": 0} if name == "v2lite" else None
    ll = llama_cpp.Llama(model_path=os.fspath(path), n_ctx=32, logits_all=True, verbose=False, n_threads=1,
                         type_k=0, type_v=0, kv_overrides=over)  # 0: GGML_TYPE_F32
    try:
        ll.eval(ids)
        got = np.array(ll.scores[:len(ids)])
    finally:
        ll.close()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
