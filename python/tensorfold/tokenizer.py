"""Byte-level BPE tokenizer built from GGUF metadata, matching llama.cpp's behaviour.

The vocabulary, merges and token types come from the ``tokenizer.ggml.*`` keys of a GGUF file;
the pre-tokenizer (a sequence of regex splits) is chosen by ``tokenizer.ggml.pre`` and mirrors
the splits llama.cpp applies for that name. Encoding runs in the Hugging Face ``tokenizers``
library (Rust); decoding is done here, with llama.cpp's rules for control / user-defined
tokens.

This module has no dependency on the native core.
"""
from __future__ import annotations

import codecs
import re
import dataclasses
import threading
import warnings
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .util import is_int as _is_int  # Python or numpy integer, bool excluded: a flag is not an id

_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """`text` with every lone surrogate (bad input, or undecodable bytes kept by Python's
    surrogateescape) replaced by U+FFFD; surrogate pairs become the character they encode.
    Such strings cannot be encoded as UTF-8, so the tokenizer would refuse them."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


__all__ = ["Tokenizer", "StreamDecoder", "TextStream", "TokenAttr", "bytes_to_unicode", "clean_text"]


# --------------------------------------------------------------------------------------
# token attributes (llama.cpp's llama_token_attr semantics, our own bit values)


class TokenAttr:
    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


# GGUF tokenizer.ggml.token_type values -> attributes
_TYPE_TO_ATTR = {
    1: TokenAttr.NORMAL,
    2: TokenAttr.UNKNOWN,
    3: TokenAttr.CONTROL,
    4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED,
    6: TokenAttr.BYTE,
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE.

    Printable Latin-1 bytes stand for themselves; the remaining 68 bytes are mapped, in
    increasing order, onto U+0100 and up.
    """
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


_BYTE_ENCODER = bytes_to_unicode()
_BYTE_DECODER = {c: b for b, c in _BYTE_ENCODER.items()}


# --------------------------------------------------------------------------------------
# pre-tokenizers: the regex splits llama.cpp applies for each tokenizer.ggml.pre name.
# Each regex splits every current piece into matches and the gaps between them (both kept),
# in order. Written for Oniguruma (the engine inside `tokenizers`).

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's adapted form: contractions are case-insensitive in ASCII only
_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_RE_LLAMA3 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    _CONTRACTIONS_CI
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a"
    "\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)


@dataclasses.dataclass(frozen=True)
class _PreSpec:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool = True  # llama.cpp's clean_up_tokenization_spaces in llama_detokenize


_PRE_DEFAULT = _PreSpec(
    regexes=(
        r"[\p{P}\$\+<=>\^~\|]+",
        _RE_GPT2,
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    )
)
_PRE_GPT2 = _PreSpec(regexes=(_RE_GPT2,))
_PRE_LLAMA3 = _PreSpec(regexes=(_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_SMAUG = _PreSpec(regexes=(_RE_LLAMA3,))
_PRE_QWEN2 = _PreSpec(regexes=(_RE_QWEN2,), clean_spaces=False)
# SmolLM / StarCoder family: every digit is its own piece, then the GPT-2 split.
_PRE_SMOLLM = _PreSpec(regexes=(r"\p{N}", _RE_GPT2), clean_spaces=False)
_PRE_STARCODER = _PreSpec(regexes=(r"\p{N}", _RE_GPT2))
_PRE_DEEPSEEK_LLM = _PreSpec(
    regexes=(
        r"[\r\n]",
        r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+\z",
        "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
        r"\p{N}+",
    ),
    clean_spaces=False,
)
_PRE_DEEPSEEK_V3 = _PreSpec(
    regexes=(
        r"\p{N}{1,3}",
        "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    clean_spaces=False,
)

PRE_TOKENIZERS: dict[str, _PreSpec] = {
    "default": _PRE_DEFAULT,
    "gpt2": _PRE_GPT2,
    "gpt-2": _PRE_GPT2,
    "phi-2": _PRE_GPT2,
    "mpt": _PRE_GPT2,
    "olmo": _PRE_GPT2,
    "jais": _PRE_GPT2,
    "llama3": _PRE_LLAMA3,
    "llama-v3": _PRE_LLAMA3,
    "llama-bpe": _PRE_LLAMA3,
    "falcon3": _PRE_LLAMA3,
    "smaug-bpe": _PRE_SMAUG,
    "dbrx": _PRE_SMAUG,
    "qwen2": _PRE_QWEN2,
    "deepseek-r1-qwen": _PRE_QWEN2,
    "stablelm2": _PreSpec(regexes=(_RE_QWEN2,)),
    "smollm": _PRE_SMOLLM,
    "starcoder": _PRE_STARCODER,
    "refact": _PRE_STARCODER,
    "codeshell": _PRE_STARCODER,
    "command-r": _PreSpec(regexes=(r"\p{N}", _RE_GPT2), clean_spaces=False),
    "deepseek-llm": _PRE_DEEPSEEK_LLM,
    "deepseek-v3": _PRE_DEEPSEEK_V3,
}

# Token texts llama.cpp treats as end-of-generation (matched by text, see llama-vocab.cpp).
_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# Texts used to find the end-of-turn token when the GGUF does not name one (first found wins).
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)


# --------------------------------------------------------------------------------------
# metadata helpers
#
# Values come from tensorfold._core.GgufFile.metadata() (numeric arrays as numpy arrays, string
# arrays as lazy GgufArray sequences) or from plain dicts of Python values. A value of the wrong
# type or range is a malformed file: always ValueError naming the key, never TypeError or
# OverflowError.


def _type_name(v: Any) -> str:
    dtype = getattr(v, "dtype", None)
    if dtype is not None and getattr(v, "ndim", 0) == 1:
        return f"an array of {dtype}"
    et = getattr(v, "elem_type", None)
    if isinstance(et, str):
        return f"an array of {et}"
    if isinstance(v, (list, tuple)):
        return "a list"
    return type(v).__name__


def _is_array(v: Any) -> bool:
    if isinstance(v, (str, bytes, bytearray, Mapping)) or getattr(v, "ndim", 1) == 0:
        return False
    return isinstance(v, (list, tuple)) or hasattr(v, "__len__") and hasattr(v, "__getitem__")


def _md_int(md: Mapping[str, Any], key: str) -> int | None:
    v = md.get(key)
    if v is None:
        return None
    if _is_array(v):
        if len(v) != 1:
            raise ValueError(f"GGUF key {key!r}: expected an integer, got {_type_name(v)}")
        v = v[0]
    if not _is_int(v):
        raise ValueError(f"GGUF key {key!r}: expected an integer, got {_type_name(v)} {v!r:.80}")
    return int(v)


def _md_bool(md: Mapping[str, Any], key: str) -> bool | None:
    """A bool; integers 0/1 and the strings "true"/"false" (any case) are accepted too, since
    some converters wrote them. Anything else is refused rather than guessed."""
    v = md.get(key)
    if v is None:
        return None
    if _is_array(v) and len(v) == 1:
        v = v[0]
    if isinstance(v, bool):
        return v
    if _is_int(v) or type(v).__name__ == "bool_":  # numpy bool / integers
        if int(v) in (0, 1):
            return bool(int(v))
    elif isinstance(v, (str, bytes, bytearray)):
        text = v.decode("utf-8", errors="replace") if not isinstance(v, str) else v
        word = text.strip().lower()
        if word in ("true", "false"):
            return word == "true"
        raise ValueError(f"GGUF key {key!r}: expected a bool, got the string {text!r:.80}")
    raise ValueError(f"GGUF key {key!r}: expected a bool, got {_type_name(v)} {v!r:.80}")


def _md_str(md: Mapping[str, Any], key: str) -> str | None:
    v = md.get(key)
    if v is None:
        return None
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", errors="replace")
    if not isinstance(v, str):
        raise ValueError(f"GGUF key {key!r}: expected a string, got {_type_name(v)}")
    return v


def _md_str_list(md: Mapping[str, Any], key: str) -> list[str] | None:
    v = md.get(key)
    if v is None:
        return None
    et = getattr(v, "elem_type", None)
    if et is not None and hasattr(v, "tolist"):  # GgufArray: one native pass
        if et != "string":
            raise ValueError(f"GGUF key {key!r}: expected an array of strings, got {_type_name(v)}")
        return v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"GGUF key {key!r}: expected an array of strings, got {_type_name(v)}")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, (bytes, bytearray)):
            x = bytes(x).decode("utf-8", errors="replace")
        elif not isinstance(x, str):
            raise ValueError(
                f"GGUF key {key!r}: expected an array of strings, element {i} is {_type_name(x)}"
            )
        out.append(x)
    return out


def _md_int_list(md: Mapping[str, Any], key: str) -> list[int] | None:
    v = md.get(key)
    if v is None:
        return None
    dtype = getattr(v, "dtype", None)
    if dtype is not None and getattr(v, "ndim", None) == 1:  # numpy array
        if dtype.kind not in "iu":
            raise ValueError(f"GGUF key {key!r}: expected an array of integers, got {_type_name(v)}")
        return v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"GGUF key {key!r}: expected an array of integers, got {_type_name(v)}")
    out = []
    for i, x in enumerate(v):
        if not _is_int(x):
            raise ValueError(
                f"GGUF key {key!r}: expected an array of integers, element {i} is {_type_name(x)}"
            )
        out.append(int(x))
    return out


# --------------------------------------------------------------------------------------


class Tokenizer:
    """A llama.cpp-compatible byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``)."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str | None = "default",
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        eom_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        fim_ids: Mapping[str, int] | None = None,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ) -> None:
        n = len(tokens)
        if n == 0:
            raise ValueError("tokenizer vocabulary is empty")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        if token_types is not None and len(token_types) < n:
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens"
            )

        pre_name = pre or "default"
        spec = PRE_TOKENIZERS.get(pre_name)
        if spec is None:
            warnings.warn(
                f"unknown pre-tokenizer {pre_name!r}; falling back to 'gpt2' "
                f"(tokenization may differ from the model's own)",
                RuntimeWarning,
                stacklevel=3,
            )
            spec = _PRE_GPT2
        self.pre = pre_name
        self._spec = spec

        self._tokens = tokens
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            self._token_to_id[t] = i  # later duplicates win, as in llama.cpp's map
        if token_types is None:
            attrs = [TokenAttr.NORMAL] * n
        else:
            attrs = [_TYPE_TO_ATTR.get(int(t), TokenAttr.UNDEFINED) for t in token_types[:n]]

        def valid(i: int | None) -> int | None:
            return i if i is not None and 0 <= i < n else None

        # Special ids: llama.cpp's defaults for gpt2-type vocabs are bos = eos = 11.
        self.bos_id: int | None = valid(bos_id if bos_id is not None else 11)
        self.eos_id: int | None = valid(eos_id if eos_id is not None else 11)
        self.unk_id: int | None = valid(unk_id)
        self.pad_id: int | None = valid(pad_id)
        fim = {k: valid(v) for k, v in (fim_ids or {}).items()}

        def find_text(texts: Iterable[str]) -> int | None:
            for t in texts:
                i = self._token_to_id.get(t)
                if i is not None:
                    return i
            return None

        def force_control(i: int | None) -> None:
            if i is not None:
                attrs[i] |= TokenAttr.CONTROL

        # auto-detected by text when the file does not name them; such tokens become control
        self.eot_id: int | None = valid(eot_id)
        if self.eot_id is None:
            self.eot_id = find_text(_EOT_TEXTS)
            force_control(self.eot_id)
        self.eom_id: int | None = valid(eom_id)
        if self.eom_id is None:
            self.eom_id = find_text(_EOM_TEXTS)
            force_control(self.eom_id)
        for key, texts in (("pad", _FIM_PAD_TEXTS), ("rep", _FIM_REP_TEXTS), ("sep", _FIM_SEP_TEXTS)):
            if fim.get(key) is None:
                fim[key] = find_text(texts)
                force_control(fim[key])

        # control tokens whose text says "unused" are unused
        for i, t in enumerate(tokens):
            if attrs[i] & TokenAttr.CONTROL and "unused" in t:
                attrs[i] |= TokenAttr.UNUSED

        eog: set[int] = {i for i in (fim.get("pad"), fim.get("rep"), fim.get("sep")) if i is not None}
        for t in _EOG_TEXTS:
            i = self._token_to_id.get(t)
            if i is not None:
                eog.add(i)
                attrs[i] |= TokenAttr.CONTROL
        for t in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            i = self._token_to_id.get(t)
            if i is not None:
                attrs[i] = TokenAttr.USER_DEFINED
        for i in (self.eos_id, self.eot_id, self.eom_id):
            if i is not None:
                eog.add(i)
        texts_in_eog = {tokens[i]: i for i in eog}
        if "<|end|>" in texts_in_eog and (
            ("<|return|>" in texts_in_eog and "<|call|>" in texts_in_eog)
            or ("<|calls|>" in texts_in_eog and "<|flush|>" in texts_in_eog)
        ):
            end = texts_in_eog["<|end|>"]
            eog.discard(end)
            attrs[end] = TokenAttr.USER_DEFINED
        self.eog_ids: frozenset[int] = frozenset(eog)
        self._attrs = attrs
        self.fim_pad_id, self.fim_rep_id, self.fim_sep_id = fim.get("pad"), fim.get("rep"), fim.get("sep")

        self.add_bos: bool = spec.add_bos if add_bos is None else bool(add_bos)
        self.add_eos: bool = False if add_eos is None else bool(add_eos)
        if self.add_bos and self.bos_id is None:
            raise ValueError("tokenizer adds a BOS token but has no valid bos_token_id")
        if self.add_eos and self.eos_id is None:
            raise ValueError("tokenizer adds an EOS token but has no valid eos_token_id")
        self.clean_spaces: bool = spec.clean_spaces

        self._merges = merges
        self._merge_pairs = self._check_merges(merges)
        self._hf = self._build_hf(encode_special=False)
        self._hf_plain = None  # lazily built: control tokens not parsed (parse_special=False)
        self._hf_lock = threading.Lock()
        self._pieces: list[bytes | None] = [None] * n
        self._special_re: "re.Pattern[str] | None | bool" = False  # built on first use

    # ----------------------------------------------------------------------------------
    # construction

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF metadata mapping (key -> value; arrays as Python lists)."""
        model = _md_str(md, "tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF has no tokenizer (missing tokenizer.ggml.model)")
        if model != "gpt2":
            raise ValueError(
                f"unsupported tokenizer model {model!r}: only byte-level BPE ('gpt2') is supported"
            )
        tokens = _md_str_list(md, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF tokenizer has no vocabulary (tokenizer.ggml.tokens)")
        merges = _md_str_list(md, "tokenizer.ggml.merges")
        if merges is None:
            raise ValueError("BPE tokenizer has no merges (tokenizer.ggml.merges)")
        types = _md_int_list(md, "tokenizer.ggml.token_type")
        fim = {
            "pad": _md_int(md, "tokenizer.ggml.fim_pad_token_id"),
            "rep": _md_int(md, "tokenizer.ggml.fim_rep_token_id"),
            "sep": _md_int(md, "tokenizer.ggml.fim_sep_token_id"),
        }
        return cls(
            tokens,
            merges,
            types,
            pre=_md_str(md, "tokenizer.ggml.pre"),
            bos_id=_md_int(md, "tokenizer.ggml.bos_token_id"),
            eos_id=_md_int(md, "tokenizer.ggml.eos_token_id"),
            eot_id=_md_int(md, "tokenizer.ggml.eot_token_id"),
            eom_id=_md_int(md, "tokenizer.ggml.eom_token_id"),
            unk_id=_md_int(md, "tokenizer.ggml.unknown_token_id"),
            pad_id=_md_int(md, "tokenizer.ggml.padding_token_id"),
            fim_ids={k: v for k, v in fim.items() if v is not None},
            add_bos=_md_bool(md, "tokenizer.ggml.add_bos_token"),
            add_eos=_md_bool(md, "tokenizer.ggml.add_eos_token"),
        )

    def _check_merges(self, merges: Sequence[str]) -> list[tuple[str, str]]:
        """Merge pairs, each checked against the vocabulary: the `tokenizers` library rejects a
        pair whose pieces or result are not tokens with a bare Exception (or a Rust panic)."""
        vocab = self._token_to_id
        pairs = []
        for i, m in enumerate(merges):
            # split at the first space after the first character (a piece may start with one)
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            a, b = m[:pos], m[pos + 1:]
            for piece in (a, b, a + b):
                if piece not in vocab:
                    raise ValueError(
                        f"tokenizer.ggml.merges[{i}] ({m!r:.80}): {piece!r:.80} is not in "
                        f"tokenizer.ggml.tokens"
                    )
            pairs.append((a, b))
        return pairs

    def _build_hf(self, encode_special: bool):
        try:
            return self._build_hf_unchecked(encode_special)
        except (MemoryError, KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as e:  # tokenizers raises bare Exception, or a Rust PanicException
            raise ValueError(
                f"cannot build the tokenizer from tokenizer.ggml.tokens / tokenizer.ggml.merges: "
                f"{type(e).__name__}: {e}"
            ) from None

    def _build_hf_unchecked(self, encode_special: bool):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = self._token_to_id
        pairs = self._merge_pairs
        bpe = models.BPE(
            vocab=vocab,
            merges=pairs,
            ignore_merges=self._spec.ignore_merges,
            fuse_unk=False,
            byte_fallback=False,
        )
        hf = HFTokenizer(bpe)
        splits = [
            pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
            for rx in self._spec.regexes
        ]
        splits.append(
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        )
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
        hf.decoder = decoders.ByteLevel()

        # Tokens llama.cpp matches atomically in text: control and unknown ones only when
        # parse_special is on, user-defined ones always.
        added = []
        for i, t in enumerate(self._tokens):
            a = self._attrs[i]
            if a & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
                added.append(AddedToken(t, special=True, normalized=False, lstrip=False,
                                        rstrip=False, single_word=False))
            elif a & TokenAttr.USER_DEFINED:
                added.append(AddedToken(t, special=False, normalized=False, lstrip=False,
                                        rstrip=False, single_word=False))
        if added:
            hf.add_tokens(added)
        hf.encode_special_tokens = encode_special
        return hf

    # ----------------------------------------------------------------------------------
    # properties

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def eot_ids(self) -> frozenset[int]:
        """Alias of ``eog_ids``: every id that ends generation."""
        return self.eog_ids

    @property
    def hf_tokenizer(self):
        """The underlying ``tokenizers.Tokenizer`` (control tokens parsed)."""
        return self._hf

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def is_control(self, token_id: int) -> bool:
        return bool(self._attrs[token_id] & TokenAttr.CONTROL)

    def token_attr(self, token_id: int) -> int:
        return self._attrs[token_id]

    def id_to_token(self, token_id: int) -> str:
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        return self._token_to_id.get(text)

    # ----------------------------------------------------------------------------------
    # encode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as llama.cpp's ``llama_tokenize`` gives them."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, not {type(text).__name__}")
        text = clean_text(text)
        if parse_special:
            hf = self._hf
        else:
            hf = self._hf_plain
            if hf is None:
                with self._hf_lock:
                    if self._hf_plain is None:
                        self._hf_plain = self._build_hf(encode_special=True)
                    hf = self._hf_plain
        ids = hf.encode(text, add_special_tokens=False).ids if text else []
        if add_special:
            if self.add_bos:
                ids.insert(0, self.bos_id)
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    @property
    def special_text_re(self) -> "re.Pattern[str] | None":
        """A regex matching the text of every token that ``encode`` parses as a control token
        (control and unknown tokens; longest first, as the tokenizer matches them), or None
        when there is none."""
        pat = self._special_re
        if pat is False:
            texts = sorted({t for i, t in enumerate(self._tokens)
                            if self._attrs[i] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN)}, key=len, reverse=True)
            pat = re.compile("|".join(map(re.escape, texts))) if texts else None
            self._special_re = pat
        return pat

    def encode_with_literals(self, text: str, literals: Mapping[str, str]) -> list[int]:
        """``encode(text, add_special=False)`` for a text in which each key of ``literals``
        (a marker) stands for its value, which is encoded as plain text: control-token strings
        in it are not parsed as control tokens. The text is cut at its own control tokens
        first, as the tokenizer does, so a marker restored inside a piece tokenizes exactly as
        that text would if it contained no control-token string (a chat message's content
        that quotes ``<|im_end|>`` cannot close its turn)."""
        special = self.special_text_re
        if not literals:
            return self.encode(text, add_special=False)
        markers = re.compile("|".join(map(re.escape, literals)))

        def plain(piece: str) -> list[int]:
            return self.encode(markers.sub(lambda m: literals[m.group()], piece), add_special=False,
                               parse_special=False)

        ids: list[int] = []
        pos = 0
        for m in (special.finditer(text) if special is not None else ()):
            if m.start() > pos:
                ids += plain(text[pos:m.start()])
            ids.append(self._token_to_id[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += plain(text[pos:])
        return ids

    def encode_batch(self, texts: Sequence[str], add_special: bool = True,
                     parse_special: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special, parse_special) for t in texts]

    # ----------------------------------------------------------------------------------
    # decode

    def _piece(self, token_id: int) -> bytes:
        p = self._pieces[token_id]
        if p is None:
            a = self._attrs[token_id]
            text = self._tokens[token_id]
            if a & (TokenAttr.CONTROL | TokenAttr.UNKNOWN | TokenAttr.USER_DEFINED):
                p = text.encode("utf-8")
            elif a & TokenAttr.NORMAL:
                out = bytearray()
                dec = _BYTE_DECODER
                for ch in text:
                    b = dec.get(ch)
                    if b is not None:
                        out.append(b)
                    else:  # not a byte-level character: llama.cpp marks it inline
                        raw = ch.encode("utf-8")
                        out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8") + b"]"
                p = bytes(out)
            elif a & TokenAttr.BYTE:
                p = _byte_token_value(text)
            else:  # unused / undefined: rendered as nothing
                p = b""
            self._pieces[token_id] = p
        return p

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {token_id} out of range [0, {len(self._tokens)})")
        return i

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes of one token. Control/unknown tokens give b"" unless ``special``."""
        i = self._check_id(token_id)
        if not special and self._attrs[i] & (TokenAttr.CONTROL | TokenAttr.UNKNOWN):
            return b""
        return self._piece(i)

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        special = not skip_special
        out = b"".join(self.token_to_piece(i, special) for i in ids)
        if self.clean_spaces:
            out = _clean_spaces(out)
        return out

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 is replaced). Control tokens are rendered as their
        text unless ``skip_special``; vocabularies whose llama.cpp config cleans tokenization
        spaces get the same clean-up as ``llama_detokenize``."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos={self.bos_id}, "
            f"eos={self.eos_id}, eog={sorted(self.eog_ids)}, add_bos={self.add_bos})"
        )


def _byte_token_value(text: str) -> bytes:
    # "<0xAB>" style byte tokens
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            pass
    b = _BYTE_DECODER.get(text)
    if b is not None:
        return bytes([b])
    return text.encode("utf-8")


def _clean_spaces(s: bytes) -> bytes:
    """llama_detokenize's clean_up_tokenization_spaces, applied to bytes."""
    if len(s) < 2:
        return s
    # " ?", " !", " .", " ,"  -> drop the space
    out = bytearray(s[:1])
    for i in range(1, len(s)):
        x = s[i]
        if s[i - 1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    s = bytes(out)
    # " ' " -> "'"
    out = bytearray(s[:1])
    i = 1
    n = len(s)
    while i < n:
        x = s[i]
        if x == 0x27 and i + 1 < n and s[i - 1] == 0x20 and s[i + 1] == 0x20:
            out.pop()
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    s = bytes(out)
    # " 's", " 'm", " 're", " 've" -> drop the space
    out = bytearray(s[:1])
    n = len(s)
    for i in range(1, n):
        x = s[i]
        if s[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = s[i + 1]
            if x1 in b"sm":
                out.pop()
            elif i + 2 < n and s[i + 1:i + 3] in (b"re", b"ve"):
                out.pop()
        out.append(x)
    return bytes(out)


class StreamDecoder:
    """Turns token ids, fed one at a time, into text without splitting UTF-8 characters.

    ``feed(id)`` returns the text completed by that token (possibly ""); ``flush()`` returns
    whatever is left at the end (an incomplete trailing sequence becomes U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._special = not skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_to_piece(token_id, self._special), final=False)

    __call__ = feed

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    def decode_iter(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the non-empty text chunks for ``ids``, then the flushed tail."""
        for i in ids:
            s = self.feed(i)
            if s:
                yield s
        tail = self.flush()
        if tail:
            yield tail


class TextStream:
    """The text of one generation as its tokens arrive, for every reader that streams it
    (Engine.stream/generate and the HTTP server): UTF-8-safe detokenization (StreamDecoder),
    the end-of-generation token that finished it left out, and stop strings matched on the
    text. Text that could still be the start of a stop string is held back; a matched stop
    string and everything after it are never emitted.

    ``feed(token, finished, reason)`` takes one engine event (token -1: none) and returns
    ``(text, reason)``: the text now safe to emit (possibly "") and the finish reason —
    the engine's when it finished, "stop" when a stop string matched (the caller then ends
    the native request), else None. After a reason was returned the stream is done.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Iterable[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._decoder = StreamDecoder(tokenizer)
        self._eog = tokenizer.eog_ids
        self._pending = ""
        self.reason: str | None = None

    def feed(self, token: int, finished: bool = False, reason: str | None = None) -> tuple[str, str | None]:
        if self.reason is not None:
            return "", self.reason
        pending = self._pending
        if token >= 0 and not (finished and reason == "stop" and token in self._eog):
            pending += self._decoder.feed(token)
        why = None
        if finished:
            why = reason
            pending += self._decoder.flush()
        if self.stops:
            cut = min((pending.find(s) for s in self.stops if s in pending), default=-1)
            if cut >= 0:
                pending = pending[:cut]
                why = "stop"
        emit = pending if why else pending[: max(0, len(pending) - self._hold)]
        self._pending = pending[len(emit):]
        self.reason = why
        return emit, why
