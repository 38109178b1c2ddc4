"""Metadata robustness: malformed or hostile GGUF metadata gives a ValueError that names the key
(never a silently wrong model, TypeError, OverflowError or UnicodeDecodeError); the reader keeps
metadata cost proportional to its bytes, refuses FIFOs/devices at once and notices a file that
shrank under its mapping.

Also home of the tiny-llama GGUF builder that tests/test_fuzz_gguf.py starts from: a 2-layer
llama written with gguf.GGUFWriter, with real tokenizer metadata trimmed from SmolLM2.
"""
from __future__ import annotations

import math
import os
import socket
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core  # noqa: E402
from tensorfold.info import describe  # noqa: E402
from tensorfold.tokenizer import Tokenizer  # noqa: E402

VT = gguf.GGUFValueType

# --------------------------------------------------------------------------------------------
# Tiny llama builder (also used by test_fuzz_gguf.py)
# --------------------------------------------------------------------------------------------

TINY = dict(n_embd=32, n_head=4, n_head_kv=2, n_ff=64, n_layer=2)


def tokenizer_metadata(smollm2_path: str, n_tokens: int = 600) -> dict:
    """SmolLM2's tokenizer metadata cut to its first n_tokens tokens (and the merges that only
    use those), as plain Python values. Read with the native reader (test_gguf_reader checks it
    against the gguf package on this very file); the gguf package takes seconds here."""
    md = _core.GgufFile(smollm2_path).metadata()

    def get(k):
        v = md[k]
        return v.tolist() if hasattr(v, "tolist") else v

    tokens = get("tokenizer.ggml.tokens")[:n_tokens]
    keep = set(tokens)
    merges = []
    for m in get("tokenizer.ggml.merges"):
        a, b = m.split(" ", 1)
        if a in keep and b in keep and a + b in keep:
            merges.append(m)
    return {
        "tokenizer.ggml.model": get("tokenizer.ggml.model"),
        "tokenizer.ggml.pre": get("tokenizer.ggml.pre"),
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [int(t) for t in get("tokenizer.ggml.token_type")[:n_tokens]],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": int(get("tokenizer.ggml.bos_token_id")),
        "tokenizer.ggml.eos_token_id": int(get("tokenizer.ggml.eos_token_id")),
        "tokenizer.ggml.unknown_token_id": int(get("tokenizer.ggml.unknown_token_id")),
        "tokenizer.ggml.padding_token_id": int(get("tokenizer.ggml.padding_token_id")),
        "tokenizer.ggml.add_bos_token": bool(get("tokenizer.ggml.add_bos_token")),
        "tokenizer.chat_template": get("tokenizer.chat_template"),
    }


_TOKENIZER_TYPES = {
    "tokenizer.ggml.model": (VT.STRING, None),
    "tokenizer.ggml.pre": (VT.STRING, None),
    "tokenizer.ggml.tokens": (VT.ARRAY, VT.STRING),
    "tokenizer.ggml.token_type": (VT.ARRAY, VT.INT32),
    "tokenizer.ggml.merges": (VT.ARRAY, VT.STRING),
    "tokenizer.ggml.bos_token_id": (VT.UINT32, None),
    "tokenizer.ggml.eos_token_id": (VT.UINT32, None),
    "tokenizer.ggml.unknown_token_id": (VT.UINT32, None),
    "tokenizer.ggml.padding_token_id": (VT.UINT32, None),
    "tokenizer.ggml.add_bos_token": (VT.BOOL, None),
    "tokenizer.chat_template": (VT.STRING, None),
}


def tiny_llama_spec(tok: dict, seed: int = 0) -> tuple[list, list]:
    """(metadata, tensors) of a valid 2-layer llama: metadata as [key, value, type, subtype],
    tensors as [name, float32 array] (numpy shape = reversed ggml ne)."""
    E, H, HK, F, L = (TINY[k] for k in ("n_embd", "n_head", "n_head_kv", "n_ff", "n_layer"))
    D = E // H
    V = len(tok["tokenizer.ggml.tokens"])
    md = [
        ["general.name", "tiny llama", VT.STRING, None],
        ["llama.block_count", L, VT.UINT32, None],
        ["llama.context_length", 256, VT.UINT32, None],
        ["llama.embedding_length", E, VT.UINT32, None],
        ["llama.feed_forward_length", F, VT.UINT32, None],
        ["llama.attention.head_count", H, VT.UINT32, None],
        ["llama.attention.head_count_kv", HK, VT.UINT32, None],
        ["llama.rope.freq_base", 10000.0, VT.FLOAT32, None],
        ["llama.attention.layer_norm_rms_epsilon", 1e-5, VT.FLOAT32, None],
        ["llama.rope.dimension_count", D, VT.UINT32, None],
    ]
    md += [[k, v, *_TOKENIZER_TYPES[k]] for k, v in tok.items()]
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    tensors = [["token_embd.weight", w(V, E)], ["output_norm.weight", np.ones(E, np.float32)]]
    for i in range(L):
        p = f"blk.{i}."
        tensors += [
            [p + "attn_norm.weight", np.ones(E, np.float32)],
            [p + "attn_q.weight", w(H * D, E)],
            [p + "attn_k.weight", w(HK * D, E)],
            [p + "attn_v.weight", w(HK * D, E)],
            [p + "attn_output.weight", w(E, H * D)],
            [p + "ffn_norm.weight", np.ones(E, np.float32)],
            [p + "ffn_gate.weight", w(F, E)],
            [p + "ffn_up.weight", w(F, E)],
            [p + "ffn_down.weight", w(E, F)],
        ]
    return md, tensors


def write_gguf(path, md, tensors, arch="llama") -> str:
    """Writes metadata ([key, value, type, subtype]) and tensors with gguf.GGUFWriter."""
    w = gguf.GGUFWriter(str(path), arch=arch)
    for key, value, vtype, sub in md:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def set_key(md, key, value, vtype, sub=None):
    """Copy of md with key set (replaced in place, or appended)."""
    out = [list(e) for e in md]
    for e in out:
        if e[0] == key:
            e[1:] = [value, vtype, sub]
            return out
    out.append([key, value, vtype, sub])
    return out


def drop_key(md, key):
    return [list(e) for e in md if e[0] != key]


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return tokenizer_metadata(smollm2_path)


@pytest.fixture(scope="module")
def spec(tok):
    return tiny_llama_spec(tok)


def engine(path):
    return _core.Engine(str(path), 1, 64, 64)


def expect_value_error(fn, *words):
    with pytest.raises(ValueError) as ei:
        fn()
    msg = str(ei.value)
    for word in words:
        assert word.lower() in msg.lower(), (word, msg)
    return msg


# --------------------------------------------------------------------------------------------
# the valid tiny model (baseline for everything below)
# --------------------------------------------------------------------------------------------


def test_tiny_llama_loads(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "tiny.gguf", md, tensors)
    e = engine(path)
    cfg = e.config
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_head"], cfg["n_head_kv"]) == (2, 32, 4, 2)
    assert cfg["n_vocab"] == 600 and cfg["name"] == "tiny llama"
    lg = e.logits([1, 20, 30])
    assert lg.shape == (3, 600) and np.isfinite(lg).all()
    f = _core.GgufFile(path)
    t = Tokenizer.from_gguf_metadata(f.metadata())
    assert t.vocab_size == 600 and t.bos_id == 1
    assert t.decode(t.encode("hello there", add_special=False)) == "hello there"


# --------------------------------------------------------------------------------------------
# integers: range-checked before narrowing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, vtype",
    [
        ("llama.feed_forward_length", 2**32 + 64, VT.UINT64),   # was read as 64
        ("llama.feed_forward_length", 2**32 + 64, VT.INT64),
        ("llama.feed_forward_length", -64, VT.INT32),
        ("llama.expert_count", 2**32, VT.UINT64),               # was read as 0: dense
        ("llama.expert_count", -1, VT.INT32),
        ("llama.block_count", 2**32 + 2, VT.UINT64),
        ("llama.block_count", 0, VT.UINT32),
        ("llama.embedding_length", 2**32 + 32, VT.INT64),
        ("llama.attention.head_count", 2**32 + 4, VT.UINT64),
        ("llama.attention.head_count_kv", 2**33 + 2, VT.UINT64),
        ("llama.attention.key_length", 2**32 + 8, VT.UINT64),
        ("llama.rope.dimension_count", 2**32 + 8, VT.UINT64),
        ("llama.context_length", -5, VT.INT32),
        ("llama.context_length", 2**40, VT.UINT64),
    ],
)
def test_integer_keys_out_of_range(tmp_path, spec, key, value, vtype):
    md, tensors = spec
    path = write_gguf(tmp_path / "bad.gguf", set_key(md, key, value, vtype), tensors)
    msg = expect_value_error(lambda: engine(path), key, "out of range", str(value))
    assert "valid:" in msg


def test_moe_counts_out_of_range(tmp_path, spec):
    md, tensors = spec
    md = set_key(md, "llama.expert_count", 4, VT.UINT32)
    for key, value in (("llama.expert_used_count", 2**32 + 2), ("llama.expert_feed_forward_length", 2**32 + 16),
                       ("llama.expert_group_count", 2**32 + 1)):
        m = set_key(set_key(md, "llama.expert_used_count", 2, VT.UINT32), key, value, VT.UINT64)
        path = write_gguf(tmp_path / "moe.gguf", m, tensors)
        expect_value_error(lambda: engine(path), key, "out of range")


# --------------------------------------------------------------------------------------------
# floats: finite and in range
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon"])
@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf, -1e-5])
def test_float_keys_refused(tmp_path, spec, key, value):
    md, tensors = spec
    path = write_gguf(tmp_path / "bad.gguf", set_key(md, key, value, VT.FLOAT32), tensors)
    msg = expect_value_error(lambda: engine(path), key, "out of range", "valid")
    assert "finite" in msg


@pytest.mark.parametrize("value", [math.nan, 0.0, -2.0, math.inf, 1e-300])
def test_rope_scaling_factor_refused(tmp_path, spec, value):
    md, tensors = spec
    md = set_key(md, "llama.rope.scaling.type", "linear", VT.STRING)
    md = set_key(md, "llama.rope.scaling.factor", value, VT.FLOAT64)
    path = write_gguf(tmp_path / "bad.gguf", md, tensors)
    expect_value_error(lambda: engine(path), "llama.rope.scaling.factor", "out of range")


def test_yarn_needs_its_keys(tmp_path, spec):
    # YaRN without the trained context length cannot place its ramp: refused by name; a bad
    # beta is refused as out of range; with them the model loads and computes.
    md, tensors = spec
    md = set_key(md, "llama.rope.scaling.type", "yarn", VT.STRING)
    md = set_key(md, "llama.rope.scaling.factor", 4.0, VT.FLOAT32)
    expect_value_error(lambda: engine(write_gguf(tmp_path / "a.gguf", md, tensors)),
                       "llama.rope.scaling.original_context_length")
    md = set_key(md, "llama.rope.scaling.original_context_length", 32, VT.UINT32)
    bad = set_key(md, "llama.rope.scaling.yarn_beta_fast", -1.0, VT.FLOAT32)
    expect_value_error(lambda: engine(write_gguf(tmp_path / "b.gguf", bad, tensors)),
                       "llama.rope.scaling.yarn_beta_fast", "out of range")
    e = engine(write_gguf(tmp_path / "ok.gguf", md, tensors))
    assert np.isfinite(e.logits(list(range(1, 40)))).all()


def test_valid_float_edges_load(tmp_path, spec):
    md, tensors = spec
    md = set_key(md, "llama.rope.freq_base", 1e6, VT.FLOAT64)
    md = set_key(md, "llama.attention.layer_norm_rms_epsilon", 1e-6, VT.FLOAT32)
    md = set_key(md, "llama.rope.scaling.type", "linear", VT.STRING)
    md = set_key(md, "llama.rope.scaling.factor", 4.0, VT.FLOAT32)
    e = engine(write_gguf(tmp_path / "ok.gguf", md, tensors))
    assert e.config["rope_base"] == 1e6
    assert np.isfinite(e.logits([1, 2])).all()


# --------------------------------------------------------------------------------------------
# block_count vs the layers present
# --------------------------------------------------------------------------------------------


def test_block_count_below_layers_present(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "bad.gguf", set_key(md, "llama.block_count", 1, VT.UINT32), tensors)
    expect_value_error(lambda: engine(path), "blk.1.", "layer 1", "llama.block_count = 1")
    # a stray tensor of a far layer is refused the same way
    extra = tensors + [["blk.7.attn_norm.weight", np.ones(32, np.float32)]]
    path = write_gguf(tmp_path / "bad2.gguf", md, extra)
    expect_value_error(lambda: engine(path), "blk.7.attn_norm.weight", "layer 7")


def test_block_count_above_layers_present_is_missing_tensor(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "bad.gguf", set_key(md, "llama.block_count", 3, VT.UINT32), tensors)
    expect_value_error(lambda: engine(path), "blk.2.")


# --------------------------------------------------------------------------------------------
# strings: non-UTF-8 never becomes UnicodeDecodeError
# --------------------------------------------------------------------------------------------


def test_architecture_errors_come_from_the_table(tmp_path, spec):
    # An unknown architecture lists what is supported; a file labelled deepseek2 without its
    # latent-attention keys names the missing key.
    md, tensors = spec
    path = write_gguf(tmp_path / "gpt2.gguf", md, tensors, arch=b"gpt2")
    with pytest.raises(_core.UnsupportedError) as ei:
        engine(path)
    msg = str(ei.value)
    assert "'gpt2'" in msg and ("supported: llama (incl. mixtral), qwen2, qwen2moe, qwen3, qwen3moe, "
                                "deepseek2 (DeepSeek V2/V3/R1, Kimi-K2, Moonlight), deepseek4 (DeepSeek V4))") in msg
    path = write_gguf(tmp_path / "ds.gguf", md, tensors, arch=b"deepseek2")
    expect_value_error(lambda: engine(path), "metadata key 'deepseek2.", "is missing")


def test_non_utf8_architecture(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "arch.gguf", md, tensors, arch=b"\xffl\xfema")
    with pytest.raises(_core.UnsupportedError) as ei:  # a ValueError subclass
        engine(path)
    assert "'\\xffl\\xfema' (general.architecture) is not supported" in str(ei.value)
    text = describe(path)  # display only: decoded with replacement
    assert "architecture:  \ufffdl\ufffdma" in text


def test_non_utf8_name_is_replaced(tmp_path, spec):
    md, tensors = spec
    md = set_key(md, "general.name", b"tiny \xff\xc3(", VT.STRING)
    e = engine(write_gguf(tmp_path / "name.gguf", md, tensors))
    assert e.config["name"] == "tiny \ufffd\ufffd("
    assert "tiny \ufffd\ufffd(" in e.config["summary"]


def test_non_utf8_path(tmp_path):
    bad = os.fsencode(str(tmp_path)) + b"/\xff\xfe.gguf"
    with pytest.raises(ValueError) as ei:
        _core.GgufFile(bad)
    assert "\\xff\\xfe.gguf: cannot open: No such file" in str(ei.value)


# --------------------------------------------------------------------------------------------
# tokenizer metadata: wrong types and values give ValueError naming the key
# --------------------------------------------------------------------------------------------


def test_add_bos_token_as_string(tmp_path, spec):
    md, tensors = spec
    for value, expected in (("false", False), ("FALSE", False), ("true", True), (" True ", True)):
        path = write_gguf(tmp_path / "bos.gguf", set_key(md, "tokenizer.ggml.add_bos_token", value, VT.STRING), tensors)
        t = Tokenizer.from_gguf_metadata(_core.GgufFile(path).metadata())
        assert t.add_bos is expected, value
        assert (t.encode("hi")[0] == t.bos_id) is expected
    path = write_gguf(tmp_path / "bos.gguf", set_key(md, "tokenizer.ggml.add_bos_token", "no", VT.STRING), tensors)
    expect_value_error(lambda: Tokenizer.from_gguf_metadata(_core.GgufFile(path).metadata()),
                       "tokenizer.ggml.add_bos_token", "bool", "'no'")
    path = write_gguf(tmp_path / "bos.gguf", set_key(md, "tokenizer.ggml.add_bos_token", 7, VT.UINT8), tensors)
    expect_value_error(lambda: Tokenizer.from_gguf_metadata(_core.GgufFile(path).metadata()),
                       "tokenizer.ggml.add_bos_token", "bool")
    path = write_gguf(tmp_path / "bos.gguf", set_key(md, "tokenizer.ggml.add_bos_token", 1, VT.UINT8), tensors)
    assert Tokenizer.from_gguf_metadata(_core.GgufFile(path).metadata()).add_bos is True


BAD_TOKENIZER_KEYS = [
    ("tokenizer.ggml.tokens", 5, VT.UINT32, None, "array of strings"),
    ("tokenizer.ggml.tokens", [1, 2, 3], VT.ARRAY, VT.INT32, "array of strings"),
    ("tokenizer.ggml.merges", 1.5, VT.FLOAT32, None, "array of strings"),
    ("tokenizer.ggml.merges", [7, 8], VT.ARRAY, VT.UINT8, "array of strings"),
    ("tokenizer.ggml.merges", ["! zz"], VT.ARRAY, VT.STRING, "not in tokenizer.ggml.tokens"),
    ("tokenizer.ggml.merges", ["! \""], VT.ARRAY, VT.STRING, "not in tokenizer.ggml.tokens"),
    ("tokenizer.ggml.token_type", 3, VT.INT32, None, "array of integers"),
    ("tokenizer.ggml.token_type", ["a", "b"], VT.ARRAY, VT.STRING, "array of integers"),
    ("tokenizer.ggml.token_type", [1.0, 2.0], VT.ARRAY, VT.FLOAT32, "array of integers"),
    ("tokenizer.ggml.token_type", [1, 1], VT.ARRAY, VT.INT32, "entries for 600 tokens"),
    ("tokenizer.ggml.bos_token_id", "1", VT.STRING, None, "integer"),
    ("tokenizer.ggml.bos_token_id", 1.5, VT.FLOAT32, None, "integer"),
    ("tokenizer.ggml.bos_token_id", math.inf, VT.FLOAT64, None, "integer"),
    ("tokenizer.ggml.eos_token_id", [1, 2], VT.ARRAY, VT.UINT32, "integer"),
    ("tokenizer.ggml.model", 3, VT.UINT32, None, "string"),
    ("tokenizer.ggml.pre", [1], VT.ARRAY, VT.UINT8, "string"),
]


@pytest.mark.parametrize("key, value, vtype, sub, words", BAD_TOKENIZER_KEYS,
                         ids=[f"{k}-{i}" for i, (k, *_rest) in enumerate(BAD_TOKENIZER_KEYS)])
def test_bad_tokenizer_metadata(tmp_path, spec, key, value, vtype, sub, words):
    md, tensors = spec
    path = write_gguf(tmp_path / "tok.gguf", set_key(md, key, value, vtype, sub), tensors)
    msg = expect_value_error(lambda: Tokenizer.from_gguf_metadata(_core.GgufFile(path).metadata()),
                             words)
    assert key in msg or "tokenizer.ggml.merges" in msg, msg


def test_tokenizer_helpers_on_plain_python_values(tok):
    """The same rules for metadata given as plain Python values (the gguf package's view)."""
    base = dict(tok)
    cases = [
        ("tokenizer.ggml.bos_token_id", float("inf")),   # OverflowError before
        ("tokenizer.ggml.bos_token_id", float("nan")),
        ("tokenizer.ggml.bos_token_id", object()),
        ("tokenizer.ggml.bos_token_id", [1, 2]),
        ("tokenizer.ggml.add_bos_token", "maybe"),
        ("tokenizer.ggml.add_bos_token", 3.0),
        ("tokenizer.ggml.tokens", 42),                    # TypeError (not iterable) before
        ("tokenizer.ggml.tokens", ["a", 1]),
        ("tokenizer.ggml.token_type", 42),                # TypeError before
        ("tokenizer.ggml.token_type", [1, "x"]),
        ("tokenizer.ggml.merges", {"a": 1}),
    ]
    for key, value in cases:
        md = dict(base)
        md[key] = value
        expect_value_error(lambda: Tokenizer.from_gguf_metadata(md), key)
    # huge ids are out of the vocabulary: ignored as llama.cpp does, not an OverflowError
    md = dict(base)
    md["tokenizer.ggml.padding_token_id"] = 2**64 - 1
    assert Tokenizer.from_gguf_metadata(md).pad_id is None


def test_tokenizer_library_errors_become_value_errors(tok):
    # a vocabulary the `tokenizers` library itself rejects (bare Exception / Rust panic)
    md = dict(tok)
    md["tokenizer.ggml.merges"] = ["\u0120 t", "zz \u0120"]
    expect_value_error(lambda: Tokenizer.from_gguf_metadata(md), "tokenizer.ggml.merges[1]", "'zz'")


def test_info_on_scalar_token_list(tmp_path, spec):
    md, tensors = spec
    md = set_key(md, "tokenizer.ggml.tokens", 12345, VT.UINT32)
    md = set_key(md, "tokenizer.chat_template", [1, 2], VT.ARRAY, VT.INT32)
    text = describe(write_gguf(tmp_path / "scalar.gguf", md, tensors))
    assert "tokenizer.ggml.tokens is not an array (12345)" in text
    assert "chat template: malformed (not a string)" in text


def test_info_cli_on_scalar_token_list(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "scalar.gguf", set_key(md, "tokenizer.ggml.tokens", 7, VT.INT8), tensors)
    r = subprocess.run([sys.executable, "-m", "tensorfold", "info", path], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "tokenizer.ggml.tokens is not an array (7)" in r.stdout


# --------------------------------------------------------------------------------------------
# the reader: FIFOs and devices, files changed under the mapping, memory per byte
# --------------------------------------------------------------------------------------------


def _run_python(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    # in a child: before the fix this blocked forever in open()
    r = _run_python(f"""
        import time
        from tensorfold import _core
        t = time.monotonic()
        try:
            _core.GgufFile({str(fifo)!r})
        except ValueError as e:
            print("ValueError", e)
        print("seconds", time.monotonic() - t)
    """, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "ValueError" in r.stdout and "not a regular file" in r.stdout and "FIFO" in r.stdout
    assert float(r.stdout.split("seconds")[1]) < 1.0


def test_socket_and_device_are_refused(tmp_path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(tmp_path / "sock"))
        expect_value_error(lambda: _core.GgufFile(str(tmp_path / "sock")), "not a regular file", "socket")
    finally:
        s.close()
    expect_value_error(lambda: _core.GgufFile("/dev/null"), "not a regular file", "character device")
    expect_value_error(lambda: _core.GgufFile(str(tmp_path)), "Is a directory")


def test_check_unchanged(tmp_path, spec):
    md, tensors = spec
    path = write_gguf(tmp_path / "m.gguf", md, tensors)
    f = _core.GgufFile(path)
    f.check_unchanged()
    size = os.path.getsize(path)
    # replaced by rename: the mapping still holds the old file, which is fine
    write_gguf(tmp_path / "new.gguf", md, tensors)
    os.replace(tmp_path / "new.gguf", path)
    f.check_unchanged()
    f = _core.GgufFile(path)
    arrs = f.metadata()["tokenizer.ggml.tokens"]
    os.truncate(path, size // 2)
    expect_value_error(f.check_unchanged, "shrank", str(size), str(size // 2), "SIGBUS")
    # everything that reads the mapping checks first
    for read in (arrs.tolist, lambda: list(arrs), lambda: arrs[5], f.metadata):
        with pytest.raises(ValueError, match="shrank"):
            read()
    path = write_gguf(tmp_path / "m2.gguf", md, tensors)
    g = _core.GgufFile(path)
    with open(path, "r+b") as fh:  # same size, bytes changed in place
        fh.seek(100)
        fh.write(b"x")
        os.utime(fh.fileno(), ns=(0, 1))
    expect_value_error(g.check_unchanged, "modified")


def _peak_rss_run(path: str) -> tuple[int, int, str]:
    r = _run_python(f"""
        import resource
        from tensorfold import _core
        import numpy  # part of the baseline
        base = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
        f = _core.GgufFile({path!r})
        md = f.metadata()
        v = md["big"]
        print(len(v), type(v).__name__, base, int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]))
    """, timeout=120)
    assert r.returncode == 0, r.stderr
    n, kind, base, peak = r.stdout.split()
    return int(base) * 1024, int(peak) * 1024, kind + ":" + n


def _gstr(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


@pytest.mark.parametrize("kind", ["u8", "nested", "strings"])
def test_metadata_memory_is_proportional_to_bytes(tmp_path, kind):
    """97 MiB of uint8 array took 2.56 GB and 8M empty nested arrays 3.38 GB before."""
    path = tmp_path / f"{kind}.gguf"
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gstr(b"big") + struct.pack("<I", int(VT.ARRAY)))
        if kind == "u8":
            n = 97 << 20
            f.write(struct.pack("<IQ", int(VT.UINT8), n))
            f.truncate(f.tell() + n)  # zeros, written sparse
        elif kind == "nested":
            n = 8 << 20
            f.write(struct.pack("<IQ", int(VT.ARRAY), n) + struct.pack("<IQ", int(VT.INT32), 0) * n)
        else:
            n = 12 << 20
            f.write(struct.pack("<IQ", int(VT.STRING), n) + struct.pack("<Q", 0) * n)
    size = os.path.getsize(path)
    base, peak, what = _peak_rss_run(str(path))
    assert what == {"u8": f"ndarray:{97 << 20}", "nested": f"GgufArray:{8 << 20}",
                    "strings": f"GgufArray:{12 << 20}"}[kind]
    # validating the arrays reads the file (its pages count as RSS); nothing per element
    assert peak - base < 1.5 * size, (kind, base, peak, size)
    assert peak < base + 3 * size


def test_lazy_array_random_access_and_iteration(tmp_path):
    n = 100_000
    items = [f"tok{i}" for i in range(n)]
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), arch="x")
    w.add_array("strs", items)
    w.add_key_value("nested", [[i, i + 1] for i in range(50)], VT.ARRAY, sub_type=VT.ARRAY)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    f = _core.GgufFile(str(tmp_path / "s.gguf"))
    a = f.metadata()["strs"]
    assert len(a) == n and a[12345] == "tok12345" and a[-1] == items[-1]
    assert list(a) == items and a.tolist() == items and a[10:13] == items[10:13]
    nested = f.get("nested")
    assert nested.tolist() == [[i, i + 1] for i in range(50)]
    assert nested[7].dtype == np.int32 and nested[7].tolist() == [7, 8]
