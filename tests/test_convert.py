"""tensorfold convert: tiny random Hugging Face models of every supported architecture are
saved with transformers, converted, and read back with gguf.GGUFReader (the oracle):
metadata, tensor names/shapes/types, values (Q/K permutation for llama recomputed here
independently), tokenizer arrays, and clear errors for bad inputs."""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from tensorfold.convert import ConvertError, add_parser, choose_pre, convert  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FF = 72, 6, 3, 2, 40
N_EXPERT, TOP_K, FF_EXP, FF_SHEXP = 5, 2, 36, 44
VOCAB = 320  # > the tokenizer's size: the tail is padding
SPECIAL = ["<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = ["[tool]"]
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! 12345 numbers and more numbers 678.",
    "Mixture-of-experts models route every token to a few experts.",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nhello!<|im_end|>",
]


def _tokenizer(llama3_split: bool):
    """A byte-level BPE split like llama-3's (llama3_split) or like Qwen2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX if llama3_split else QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT * 4, trainer=trainer)
    tok.add_tokens(USER_DEFINED)
    return tok


SPECS = {
    # name: (config class, model class, extra config, llama-style tokenizer)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=50000.0), True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), False),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), False),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(head_dim=16, num_experts=N_EXPERT, num_experts_per_tok=TOP_K,
                      moe_intermediate_size=FF_EXP, norm_topk_prob=True), False),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(num_experts=N_EXPERT, num_experts_per_tok=TOP_K, moe_intermediate_size=FF_EXP,
                      shared_expert_intermediate_size=FF_SHEXP), False),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=N_EXPERT, num_experts_per_tok=TOP_K, intermediate_size=FF_EXP), True),
}


def _save(root, name, *, shard=None, dtype=None, seed=0):
    cfg_cls, model_cls, extra, llama_tok = SPECS[name]
    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024)
    kw.update(extra)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # norms are ones at init: randomise them so a mix-up would show
        for n, prm in model.named_parameters():
            if prm.ndim == 1:
                prm.copy_(1.0 + 0.1 * torch.randn_like(prm))
    if dtype is not None:
        model = model.to(dtype)
    d = root / (name + (f"-{shard}" if shard else "") + (f"-{dtype}".replace("torch.", "") if dtype else ""))
    model.save_pretrained(d, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    tok = _tokenizer(llama_tok)
    tok.save(str(d / "tokenizer.json"))
    tcfg = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    if llama_tok:
        tcfg["bos_token"] = "<|begin_of_text|>"
    else:
        tcfg.update(bos_token=None, pad_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg))
    state = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    return d, cfg, state


def _fields(reader):
    return {k: f.contents() for k, f in reader.fields.items()}


def _tensors(reader):
    out = {}
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type) if t.tensor_type not in (Q.F32, Q.F16) else np.asarray(t.data)
        out[t.name] = (t.tensor_type, [int(x) for x in t.shape], np.asarray(arr, dtype=np.float32))
    return out


def _permute_reference(w, n_head):
    """Independent statement of the fact: GGUF row h*d + 2i + j = HF row h*d + j*d/2 + i."""
    rows, cols = w.shape
    d = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            for j in range(2):
                out[h * d + 2 * i + j] = w[h * d + j * (d // 2) + i]
    return out


def _expected(name, cfg, state):
    """GGUF tensor name → expected float32 array (numpy order)."""
    arch_llama = name in ("llama", "mixtral")
    hd = getattr(cfg, "head_dim", None) or HIDDEN // HEADS
    exp = {"token_embd.weight": state["model.embed_tokens.weight"],
           "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        exp["output.weight"] = state["lm_head.weight"]
    for i in range(LAYERS):
        h, b = f"model.layers.{i}", f"blk.{i}"
        exp[f"{b}.attn_norm.weight"] = state[f"{h}.input_layernorm.weight"]
        exp[f"{b}.ffn_norm.weight"] = state[f"{h}.post_attention_layernorm.weight"]
        q, k = state[f"{h}.self_attn.q_proj.weight"], state[f"{h}.self_attn.k_proj.weight"]
        if arch_llama:
            q, k = _permute_reference(q, HEADS), _permute_reference(k, KV_HEADS)
        exp[f"{b}.attn_q.weight"], exp[f"{b}.attn_k.weight"] = q, k
        exp[f"{b}.attn_v.weight"] = state[f"{h}.self_attn.v_proj.weight"]
        exp[f"{b}.attn_output.weight"] = state[f"{h}.self_attn.o_proj.weight"]
        if name in ("qwen2", "qwen2moe"):
            for g, p in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                exp[f"{b}.{g}.bias"] = state[f"{h}.self_attn.{p}.bias"]
        if name in ("qwen3", "qwen3moe"):
            exp[f"{b}.attn_q_norm.weight"] = state[f"{h}.self_attn.q_norm.weight"]
            exp[f"{b}.attn_k_norm.weight"] = state[f"{h}.self_attn.k_norm.weight"]
            assert hd == 16
        if name in ("llama", "qwen2", "qwen3"):
            for g in ("gate", "up", "down"):
                exp[f"{b}.ffn_{g}.weight"] = state[f"{h}.mlp.{g}_proj.weight"]
            continue
        # MoE: per-expert tensors of the model's own state_dict, or the fused 3-D ones
        pre = f"{h}.mlp"
        exp[f"{b}.ffn_gate_inp.weight"] = state[f"{pre}.gate.weight"]
        if f"{pre}.experts.gate_up_proj" in state:
            gu = state[f"{pre}.experts.gate_up_proj"]
            f = gu.shape[1] // 2
            exp[f"{b}.ffn_gate_exps.weight"], exp[f"{b}.ffn_up_exps.weight"] = gu[:, :f], gu[:, f:]
            exp[f"{b}.ffn_down_exps.weight"] = state[f"{pre}.experts.down_proj"]
        else:
            for g in ("gate", "up", "down"):
                exp[f"{b}.ffn_{g}_exps.weight"] = np.stack(
                    [state[f"{pre}.experts.{e}.{g}_proj.weight"] for e in range(N_EXPERT)])
        if name == "qwen2moe":
            exp[f"{b}.ffn_gate_inp_shexp.weight"] = state[f"{pre}.shared_expert_gate.weight"]
            for g in ("gate", "up", "down"):
                exp[f"{b}.ffn_{g}_shexp.weight"] = state[f"{pre}.shared_expert.{g}_proj.weight"]
    return exp


def _check(path, name, cfg, state, tok_dir, outtype):
    r = gguf.GGUFReader(path)
    kv = _fields(r)
    arch = {"mixtral": "llama"}.get(name, name)
    moe = name in ("qwen3moe", "qwen2moe", "mixtral")
    hd = getattr(cfg, "head_dim", None) or HIDDEN // HEADS
    want = {
        "general.architecture": arch,
        "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}[outtype],
        f"{arch}.vocab_size": VOCAB,
        f"{arch}.context_length": 1024,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.block_count": LAYERS,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.rope.dimension_count": hd,
    }
    for k, v in want.items():
        assert kv[k] == v, (k, kv[k], v)
    assert kv[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps, rel=1e-6)
    theta = 50000.0 if name == "llama" else cfg.rope_parameters["rope_theta"]
    assert kv[f"{arch}.rope.freq_base"] == pytest.approx(theta)
    if hd * HEADS != HIDDEN:
        assert kv[f"{arch}.attention.key_length"] == hd and kv[f"{arch}.attention.value_length"] == hd
    else:
        assert f"{arch}.attention.key_length" not in kv
    if moe:
        assert kv[f"{arch}.expert_count"] == N_EXPERT and kv[f"{arch}.expert_used_count"] == TOP_K
        assert kv[f"{arch}.expert_weights_norm"] is (name != "qwen2moe")
        if name != "mixtral":
            assert kv[f"{arch}.expert_feed_forward_length"] == FF_EXP
        if name == "qwen2moe":
            assert kv[f"{arch}.expert_shared_feed_forward_length"] == FF_SHEXP
    else:
        assert f"{arch}.expert_count" not in kv

    # tokenizer arrays against tokenizer.json itself
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    id_to = {i: t for t, i in tj["model"]["vocab"].items()}
    specials = {a["id"]: a for a in tj["added_tokens"]}
    id_to.update({i: a["content"] for i, a in specials.items()})
    n = max(id_to) + 1
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == VOCAB and tokens[:n] == [id_to[i] for i in range(n)]
    assert all(t == f"[PAD{i}]" for i, t in enumerate(tokens) if i >= n)
    types = kv["tokenizer.ggml.token_type"]
    for i in range(VOCAB):
        w = 5 if i >= n else (3 if specials[i]["special"] else 4) if i in specials else 1
        assert types[i] == w, (i, tokens[i], types[i])
    assert USER_DEFINED[0] in tokens and types[tokens.index(USER_DEFINED[0])] == 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert kv["tokenizer.ggml.merges"] == merges and len(merges) > 0
    assert kv["tokenizer.ggml.model"] == "gpt2"
    llama_tok = SPECS[name][3]
    assert kv["tokenizer.ggml.pre"] == ("llama-bpe" if llama_tok else "qwen2")
    assert kv["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    if llama_tok:
        assert kv["tokenizer.ggml.bos_token_id"] == tokens.index("<|begin_of_text|>")
        assert kv["tokenizer.ggml.add_bos_token"] is True
    else:
        assert "tokenizer.ggml.bos_token_id" not in kv
        assert kv["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
        assert kv["tokenizer.ggml.add_bos_token"] is False
    assert kv["tokenizer.chat_template"] == CHATML
    # TensorFold's tokenizer (which mirrors llama.cpp's) on the converted vocabulary splits
    # text exactly like the tokenizers library on tokenizer.json: the pre choice is right
    from tensorfold.tokenizer import Tokenizer as TfTokenizer
    from tokenizers import Tokenizer as HfTokenizer

    tf_tok, hf_tok = TfTokenizer.from_gguf_metadata(kv), HfTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    for text in TEXT + ["Numbers 1234567 and 89, apostrophes it's THEY'LL\n\n  spaced   out [tool] x"]:
        assert tf_tok.encode(text, add_special=False) == hf_tok.encode(text, add_special_tokens=False).ids, text

    # tensors: names, shapes (GGUF ne order), types, values
    exp = _expected(name, cfg, state)
    got = _tensors(r)
    assert sorted(got) == sorted(exp)
    for tname, want_arr in exp.items():
        ttype, ne, arr = got[tname]
        assert ne == list(reversed(want_arr.shape)), tname
        f32_kind = want_arr.ndim == 1 or "ffn_gate_inp" in tname
        if f32_kind or outtype == "f32":
            assert ttype == Q.F32, tname
            np.testing.assert_array_equal(arr, want_arr, err_msg=tname)
        elif outtype == "q8_0" and want_arr.shape[-1] % 32 == 0:
            assert ttype == Q.Q8_0, tname
            ref = dequantize(quantize(want_arr.astype(np.float32), Q.Q8_0), Q.Q8_0)
            np.testing.assert_array_equal(arr, ref, err_msg=tname)
        elif outtype == "bf16":
            assert ttype == Q.BF16, tname
            np.testing.assert_array_equal(arr, want_arr, err_msg=tname)  # source was bf16: exact
        else:  # f16, or q8_0's fallback for rows that are not a multiple of 32
            assert ttype == Q.F16, tname
            np.testing.assert_array_equal(arr, want_arr.astype(np.float16).astype(np.float32), err_msg=tname)
    return kv, got


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral"])
def test_convert_f32_exact(tmp_path, name):
    d, cfg, state = _save(tmp_path, name)
    out = convert(d, tmp_path / "out.gguf", "f32", progress=False)
    assert out == os.fspath(tmp_path / "out.gguf")
    _check(out, name, cfg, state, d, "f32")


def test_sharded_llama_f16(tmp_path):
    d, cfg, state = _save(tmp_path, "llama", shard="60KB")
    assert (d / "model.safetensors.index.json").exists()
    assert len(list(d.glob("*.safetensors"))) > 2
    out = convert(d, tmp_path / "out.gguf", "f16", progress=False)
    _check(out, "llama", cfg, state, d, "f16")


def test_sharded_mixtral_q8_0(tmp_path, capsys):
    d, cfg, state = _save(tmp_path, "mixtral", shard="50KB")
    assert len(list(d.glob("*.safetensors"))) > 2
    out = convert(d, tmp_path / "out.gguf", "q8_0", progress=True)
    _check(out, "mixtral", cfg, state, d, "q8_0")
    assert "not a multiple of 32" in capsys.readouterr().err


def test_qwen3_q8_0(tmp_path):
    # head_dim 16 x 6 heads = 96 columns in attn_output: a multiple of 32, so it gets Q8_0;
    # the other weights (72/40 columns) fall back to F16
    d, cfg, state = _save(tmp_path, "qwen3")
    out = convert(d, tmp_path / "out.gguf", "q8_0", progress=False)
    _, got = _check(out, "qwen3", cfg, state, d, "q8_0")
    assert got["blk.0.attn_output.weight"][0] == Q.Q8_0
    assert got["blk.0.attn_q.weight"][0] == Q.F16


def test_bf16_checkpoint_to_bf16(tmp_path):
    d, cfg, state = _save(tmp_path, "qwen2moe", dtype=torch.bfloat16)
    st = json.loads((d / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (d / "model.safetensors").read_bytes()[:8], "little")])
    assert st["model.embed_tokens.weight"]["dtype"] == "BF16"
    out = convert(d, tmp_path / "out.gguf", "bf16", progress=False)
    _check(out, "qwen2moe", cfg, state, d, "bf16")


def test_cli_subcommand(tmp_path):
    d, cfg, state = _save(tmp_path, "qwen3")
    ap = argparse.ArgumentParser(prog="tensorfold")
    add_parser(ap.add_subparsers(dest="cmd"))
    out = tmp_path / "cli.gguf"
    a = ap.parse_args(["convert", str(d), "-o", str(out), "--outtype", "f32", "-q"])
    assert a.func(a) == 0
    _check(str(out), "qwen3", cfg, state, d, "f32")
    assert a.func(a) == 2  # exists, no --force
    help_text = ap._subparsers._group_actions[0].choices["convert"].format_help()
    assert "--outtype" in help_text and "q8_0" in help_text


def test_choose_pre():
    seq = lambda *xs: {"type": "Sequence", "pretokenizers": list(xs)}  # noqa: E731
    bl = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    qsplit = {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated"}
    assert choose_pre("llama", {"pre_tokenizer": seq(qsplit, dict(bl, use_regex=False))}) == "qwen2"
    assert choose_pre("qwen3moe", {"pre_tokenizer": bl}) == "gpt-2"
    split = {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated"}
    assert choose_pre("llama", {"pre_tokenizer": seq(split, dict(bl, use_regex=False))}) == "llama-bpe"
    digits = {"type": "Digits", "individual_digits": True}
    assert choose_pre("llama", {"pre_tokenizer": seq(digits, bl)}) == "smollm"
    assert choose_pre("llama", {"pre_tokenizer": bl}) == "gpt-2"
    # Never guessed (no architecture fallback, no "default"): anything else is refused.
    unknown = [None, {"type": "Whitespace"}, seq(dict(qsplit, pattern={"Regex": r"\p{L}+|\p{N}+"}),
                                                 dict(bl, use_regex=False)),
               seq(split, bl),  # ByteLevel's own regex after the split: a different split
               dict(bl, add_prefix_space=True), seq(digits, dict(bl, use_regex=False))]
    for pre in unknown:
        for arch in ("llama", "qwen3moe"):
            with pytest.raises(ConvertError, match="not one TensorFold recognises.*llama-bpe.*--pre NAME"):
                choose_pre(arch, {"pre_tokenizer": pre})


def _with_pre_tokenizer(src, dst, pre):
    d = _copy(src, dst)
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = pre
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


def test_unknown_pre_tokenizer_is_refused_or_named(tmp_path, good_dir):
    """An unrecognised pre-tokenizer stops the conversion (no file written); --pre names one."""
    d = _with_pre_tokenizer(good_dir, tmp_path / "m", {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\p{L}+| ?\p{N}"}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]})
    out = tmp_path / "x.gguf"
    with pytest.raises(ConvertError, match=r"Split\(.*not one TensorFold recognises.*qwen2: Split"):
        convert(d, out, "f32", progress=False)
    assert not out.exists() and not (tmp_path / "x.gguf.part").exists()
    with pytest.raises(ConvertError, match="pre-tokenizer 'nope' is not one of .*llama-bpe"):
        convert(d, out, "f32", progress=False, pre="nope")

    ap = argparse.ArgumentParser(prog="tensorfold")
    add_parser(ap.add_subparsers(dest="cmd"))
    a = ap.parse_args(["convert", str(d), "-o", str(out), "--outtype", "f32", "-q"])
    assert a.func(a) == 1 and not out.exists()
    a = ap.parse_args(["convert", str(d), "-o", str(out), "--outtype", "f32", "-q", "--pre", "qwen2"])
    assert a.func(a) == 0
    assert gguf.GGUFReader(str(out)).fields["tokenizer.ggml.pre"].contents() == "qwen2"


# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    d, _, _ = _save(tmp_path_factory.mktemp("good"), "qwen3")
    return d


def _copy(src, dst, skip=(), cfg_update=None):
    import shutil

    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            shutil.copy(f, dst / f.name)
    if cfg_update is not None:
        cfg = json.loads((src / "config.json").read_text())
        cfg.update(cfg_update)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_config(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m", skip=("config.json",))
    with pytest.raises(ConvertError, match="config.json not found"):
        convert(d, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists()


def test_not_a_directory(tmp_path):
    with pytest.raises(ConvertError, match="not a directory"):
        convert(tmp_path / "nope", tmp_path / "x.gguf", progress=False)


def test_unsupported_architecture(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m", cfg_update={"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConvertError, match="unsupported architecture 'GPT2LMHeadModel'.*Qwen3MoeForCausalLM"):
        convert(d, tmp_path / "x.gguf", progress=False)


def test_missing_tokenizer(tmp_path, good_dir):
    d = _copy(good_dir, tmp_path / "m", skip=("tokenizer.json",))
    with pytest.raises(ConvertError, match="tokenizer.json not found"):
        convert(d, tmp_path / "x.gguf", progress=False)
    (d / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ConvertError, match="SentencePiece.*not supported yet"):
        convert(d, tmp_path / "x.gguf", progress=False)


@pytest.mark.parametrize("update,match", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "needs original_max_position"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "truncate": False,
                          "original_max_position_embeddings": 64}}, "truncate=false"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "rope_parameters": None}, "rope scaling type 'llama3'"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_attention_heads": 5}, "not a multiple"),
    ({"tie_word_embeddings": True}, "differs"),
    ({"hidden_size": 80}, "shape"),
])
def test_refused_configs(tmp_path, good_dir, update, match):
    d = _copy(good_dir, tmp_path / "m", cfg_update=update)
    with pytest.raises(ConvertError, match=match):
        convert(d, tmp_path / "x.gguf", progress=False)
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.part").exists()


def test_refused_moe_layouts(tmp_path):
    d, _, _ = _save(tmp_path, "qwen3moe")
    for update, match in (({"mlp_only_layers": [1]}, "mlp_only_layers"),
                          ({"decoder_sparse_step": 2}, "decoder_sparse_step")):
        dd = _copy(d, tmp_path / match, cfg_update=update)
        with pytest.raises(ConvertError, match=match):
            convert(dd, tmp_path / "x.gguf", progress=False)


def test_bad_outtype(tmp_path, good_dir):
    with pytest.raises(ConvertError, match="outtype"):
        convert(good_dir, tmp_path / "x.gguf", "q4_0", progress=False)
