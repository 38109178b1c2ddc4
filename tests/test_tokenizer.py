"""Tokenizer vs llama.cpp: fixtures from tests/fixtures/make_llama_fixtures.py on the SmolLM2 GGUF."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tensorfold.tokenizer import StreamDecoder, Tokenizer, bytes_to_unicode

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json"


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def _metadata(path: str) -> dict:
    """GGUF metadata from the native reader (numeric arrays as numpy arrays, string arrays as
    lazy GgufArray sequences), as the Engine passes it to the tokenizer."""
    from tensorfold import _core

    return dict(_core.GgufFile(path).metadata())


@pytest.fixture(scope="module")
def metadata(smollm2_path) -> dict:
    return _metadata(smollm2_path)


@pytest.fixture(scope="module")
def tok(metadata) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata)


def _case_ids(fx):
    return [c["name"] for c in fx["tokenize"]]


def test_fixture_matches_model(fixture, smollm2_path):
    from tensorfold.util import sha256_file

    assert sha256_file(smollm2_path) == fixture["model"]["sha256"]


def test_vocab_facts(tok, fixture):
    v = fixture["vocab"]
    assert tok.vocab_size == v["n_vocab"]
    assert tok.bos_id == v["bos_id"]
    assert tok.eos_id == v["eos_id"]
    assert tok.add_bos == v["add_bos"]
    assert tok.add_eos == v["add_eos"]
    assert sorted(tok.eog_ids) == v["eog_ids"]
    assert tok.eot_ids == tok.eog_ids
    # llama.cpp picks the end-of-turn token by text from a hash map (order unspecified);
    # whichever it is, it ends generation
    assert tok.eot_id in tok.eog_ids and v["eot_id"] in tok.eog_ids
    assert [i for i in range(tok.vocab_size) if tok.is_control(i)] == v["control_ids"]


def test_every_piece_matches_llama_cpp(tok, fixture):
    h = hashlib.sha256()
    for i in range(tok.vocab_size):
        p = tok.token_to_piece(i)
        h.update(len(p).to_bytes(4, "little") + p)
    assert h.hexdigest() == fixture["vocab"]["pieces_sha256"]


def test_fixture_has_enough_cases(fixture):
    assert len(fixture["tokenize"]) >= 25


def test_encode_matches_llama_cpp(tok, fixture):
    bad = []
    for c in fixture["tokenize"]:
        for key, kw in (
            ("ids_with_special", dict(add_special=True)),
            ("ids_no_special", dict(add_special=False)),
            ("ids_parse_special_false", dict(add_special=False, parse_special=False)),
        ):
            got = tok.encode(c["text"], **kw)
            if got != c[key]:
                bad.append((c["name"], key, got[:16], c[key][:16]))
    assert not bad, bad


def test_decode_matches_llama_cpp(tok, fixture):
    bad = []
    for c in fixture["tokenize"]:
        ids = c["ids_no_special"]
        if tok.decode(ids, skip_special=True) != c["detok"]:
            bad.append((c["name"], "skip_special"))
        if tok.decode(ids) != c["detok_special"]:
            bad.append((c["name"], "special"))
    assert not bad, bad


def test_roundtrip_text(tok, fixture):
    for c in fixture["tokenize"]:
        assert tok.decode(tok.encode(c["text"], add_special=False)) == c["text"], c["name"]


def test_greedy_prompt_ids(tok, fixture):
    for g in fixture["greedy"]:
        assert tok.encode(g["prompt"], add_special=True) == g["prompt_ids"]
        assert tok.decode(g["generated_ids"]) == g["generated_text"]


def _stream(tok, ids, skip_special=False):
    sd = StreamDecoder(tok, skip_special=skip_special)
    chunks = [sd.feed(i) for i in ids]
    chunks.append(sd.flush())
    return chunks


def test_stream_decoder_reproduces_text(tok, fixture):
    for c in fixture["tokenize"]:
        ids = c["ids_no_special"]
        chunks = _stream(tok, ids)
        assert "".join(chunks) == c["detok_special"], c["name"]
        for ch in chunks:
            assert "\ufffd" not in ch or "\ufffd" in c["text"]
            ch.encode("utf-8")  # no lone surrogates
        assert "".join(_stream(tok, ids, skip_special=True)) == c["detok"]


def test_stream_decoder_never_splits_characters(tok):
    text = "🤷\u200d♂️ 日本語テキスト 👨\u200d👩\u200d👧\u200d👦 é"
    ids = tok.encode(text, add_special=False)
    pieces = [tok.token_to_piece(i) for i in ids]
    # the test only means something when some token ends inside a multi-byte character
    splits = 0
    for p in pieces:
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            splits += 1
    assert splits > 0
    sd = StreamDecoder(tok)
    out = []
    for i in ids:
        s = sd.feed(i)
        assert "\ufffd" not in s
        out.append(s)
    out.append(sd.flush())
    assert "".join(out) == text


def test_stream_decoder_flushes_incomplete_tail(tok):
    ids = tok.encode("🍕", add_special=False)
    assert len(ids) > 1
    sd = StreamDecoder(tok)
    assert sd.feed(ids[0]) == ""
    assert sd.flush() == "\ufffd"  # incomplete sequence at the end
    assert list(StreamDecoder(tok).decode_iter(ids)) == ["🍕"]


def test_special_tokens(tok):
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    assert tok.encode("<|im_start|>", add_special=False) == [im_start]
    assert im_start not in tok.encode("<|im_start|>", add_special=False, parse_special=False)
    assert tok.is_eog(im_end)
    assert tok.token_to_piece(im_end) == b"<|im_end|>"
    assert tok.token_to_piece(im_end, special=False) == b""
    assert tok.decode([im_start, im_end], skip_special=True) == ""


def test_bad_ids_and_inputs(tok):
    with pytest.raises(ValueError):
        tok.token_to_piece(tok.vocab_size)
    with pytest.raises(ValueError):
        tok.decode([-1])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_metadata_errors(metadata):
    with pytest.raises(ValueError, match="tokenizer"):
        Tokenizer.from_gguf_metadata({})
    md = dict(metadata)
    md["tokenizer.ggml.model"] = "llama"
    with pytest.raises(ValueError, match="unsupported tokenizer model"):
        Tokenizer.from_gguf_metadata(md)
    md = dict(metadata)
    del md["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="merges"):
        Tokenizer.from_gguf_metadata(md)


def test_unknown_pre_falls_back_to_gpt2(metadata):
    md = dict(metadata)
    md["tokenizer.ggml.pre"] = "no-such-pre-tokenizer"
    with pytest.warns(RuntimeWarning, match="gpt2"):
        t = Tokenizer.from_gguf_metadata(md)
    # gpt2 keeps a digit run in one piece where smollm splits every digit
    assert [p for p, _ in t.hf_tokenizer.pre_tokenizer.pre_tokenize_str("1234")] == ["1234"]
    assert t.pre == "no-such-pre-tokenizer"


def test_add_bos_default_and_override(metadata):
    md = dict(metadata)
    md.pop("tokenizer.ggml.add_bos_token", None)
    t = Tokenizer.from_gguf_metadata(md)
    assert t.add_bos is False  # llama.cpp's default for smollm (gpt2-type vocab)
    md["tokenizer.ggml.add_bos_token"] = True
    t = Tokenizer.from_gguf_metadata(md)
    assert t.encode("hi")[0] == t.bos_id
    md["tokenizer.ggml.pre"] = "llama-bpe"
    md.pop("tokenizer.ggml.add_bos_token")
    assert Tokenizer.from_gguf_metadata(md).add_bos is True  # llama3 pre defaults to BOS


def _toy_vocab():
    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_chars
    return tokens, [3, 3, 3] + [1] * 256


@pytest.mark.parametrize(
    "pre,text,pieces",
    [
        ("gpt2", "ab 123", ["ab", " 123"]),
        ("smollm", "ab 123", ["ab", " ", "1", "2", "3"]),
        ("llama-bpe", "ab 12345", ["ab", " ", "123", "45"]),
        ("qwen2", "ab 123", ["ab", " ", "1", "2", "3"]),
        ("deepseek-v3", "ab 1234", ["ab", " ", "123", "4"]),
        ("deepseek-llm", "ab\n12", ["ab", "\n", "12"]),
        ("default", "a+b 1234", ["a", "+", "b", " ", "123", "4"]),
    ],
)
def test_pre_tokenizer_splits(pre, text, pieces):
    tokens, types = _toy_vocab()
    t = Tokenizer(tokens, [], types, pre=pre, bos_id=0, eos_id=0)
    split = t.hf_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    enc = bytes_to_unicode()
    assert [s for s, _ in split] == ["".join(enc[b] for b in p.encode()) for p in pieces]
    # with no merges every byte is one token, and decoding gives the text back
    assert t.decode(t.encode(text, add_special=False)) == text
