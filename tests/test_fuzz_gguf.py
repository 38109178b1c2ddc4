"""A seeded GGUF mutation fuzzer.

Seeds: (a) a complete tiny llama written with gguf.GGUFWriter, with real tokenizer metadata cut
from SmolLM2 (see test_metadata_validation.py), and (b) the header (metadata + tensor table) of
the real SmolLM2 GGUF, its tensor data left as a sparse run of zeros. Each case applies one to
three mutations to the header fields, metadata keys/types/values/array lengths, tensor infos
(names, dims, type ids, offsets), alignment and data, or truncates the file, then opens the
mutant with tensorfold._core.GgufFile, reads metadata(), builds the tokenizer, renders the chat
template, runs `tensorfold info`, and for mutants of the tiny model loads an Engine and runs a
forward pass.

A case passes when each step either works or raises ValueError (UnsupportedError and the
chat template's TemplateError are ValueErrors) or MemoryError with a message. It fails on any
other exception, a crash (cases run in child processes that report every case they start, so a
dead child names its case), a hang or a peak RSS above 1 GB. A hang is a case that used more
than its CPU-time budget (a busy loop), or that did not finish within a wall-clock limit many
times longer (a deadlock): CPU time does not stretch when the machine is busy, so a loaded
machine cannot make a slow but working case look like a hang.

Default run: a few hundred cases. `-m slow`: thousands. TENSORFOLD_FUZZ_SEED / _CASES change the
seed and count; TENSORFOLD_FUZZ_KEEP=DIR writes the recipe of each failing case there, and
`python tests/test_fuzz_gguf.py --make SMOLLM2_GGUF CASE SEED OUT` rebuilds its mutant.
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import select
import struct
import subprocess
import sys
import tempfile
import time

import pytest

# --------------------------------------------------------------------------------------------
# A test-local GGUF model: parse to fields, mutate, serialise back (byte-exact for valid files)
# --------------------------------------------------------------------------------------------

FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
         10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
INT_RANGES = {0: (0, 2**8 - 1), 1: (-2**7, 2**7 - 1), 2: (0, 2**16 - 1), 3: (-2**15, 2**15 - 1),
              4: (0, 2**32 - 1), 5: (-2**31, 2**31 - 1), 7: (0, 1), 10: (0, 2**64 - 1),
              11: (-2**63, 2**63 - 1)}


class Model:
    """Fields of a GGUF file. kvs: [key bytes, vtype, value] (arrays: (elem_type, items),
    strings: bytes); tensors: [name bytes, ne list, type id, relative offset, data bytes|None].
    n_tensors / n_kvs / n_dims override the counts written; data_size (with data None) writes
    the data section as a sparse run of zeros."""

    def __init__(self):
        self.version = 3
        self.kvs: list = []
        self.tensors: list = []
        self.n_tensors = None
        self.n_kvs = None
        self.alignment = 32
        self.data: bytes | None = b""
        self.data_size = 0

    def copy(self) -> "Model":
        m = Model()
        m.__dict__.update(self.__dict__)
        m.kvs = [list(kv) for kv in self.kvs]
        m.tensors = [[t[0], list(t[1]), t[2], t[3], t[4]] for t in self.tensors]
        return m

    def find(self, key: bytes):
        for kv in self.kvs:
            if kv[0] == key:
                return kv
        return None


def parse(buf: bytes, data: bool = True) -> Model:
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, buf, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        s = buf[pos:pos + n]
        pos += n
        return s

    def value(t):
        if t == STRING:
            return string()
        if t == ARRAY:
            et, n = take("<I"), take("<Q")
            return et, [value(et) for _ in range(n)]
        return take(FIXED[t])

    m = Model()
    assert buf[:4] == b"GGUF"
    pos = 4
    m.version = take("<I")
    tc, kc = take("<Q"), take("<Q")
    for _ in range(kc):
        key = string()
        t = take("<I")
        m.kvs.append([key, t, value(t)])
    for _ in range(tc):
        name = string()
        nd = take("<I")
        ne = [take("<Q") for _ in range(nd)]
        m.tensors.append([name, ne, take("<I"), take("<Q"), None])
    kv = m.find(b"general.alignment")
    m.alignment = kv[2] if kv and kv[1] == 4 else 32
    data_off = (pos + m.alignment - 1) // m.alignment * m.alignment
    if data:
        m.data = buf[data_off:]
        m.data_size = len(m.data)
        for t in m.tensors:
            n = tensor_nbytes(t[1], t[2])
            if n is not None:
                t[4] = m.data[t[3]:t[3] + n]
    return m


def _f32(v: float) -> float:
    """float32 has no 1e300: such values are written as inf, as a C cast does."""
    return v if not math.isfinite(v) or abs(v) <= 3.4028234663852886e38 else math.copysign(math.inf, v)


def enc_value(t: int, v) -> bytes:
    if t == 6:
        return struct.pack("<f", _f32(v))
    if t in FIXED:
        return struct.pack(FIXED[t], v)
    if t == STRING:
        return struct.pack("<Q", len(v)) + v
    if t == ARRAY:
        et, items = v
        head = struct.pack("<IQ", et, len(items))
        if et == STRING:
            return head + b"".join(struct.pack("<Q", len(x)) + x for x in items)
        if et == 6:
            items = [_f32(x) for x in items]
        if et in FIXED:
            return head + struct.pack("<%d%s" % (len(items), FIXED[et][1]), *items)
        return head + b"".join(enc_value(et, x) for x in items)
    return bytes(v)  # unknown type: raw bytes


def serialize(m: Model, marks: list | None = None) -> tuple[bytes, int]:
    """(file bytes without a sparse tail, total size). marks, when given, receives
    (byte offset, struct format, what) of every count, length, type and offset field."""
    out = [b"GGUF", struct.pack("<I", m.version),
           struct.pack("<QQ", len(m.tensors) if m.n_tensors is None else m.n_tensors,
                       len(m.kvs) if m.n_kvs is None else m.n_kvs)]
    pos = 24

    def add(part: bytes, fmt: str | None = None, what: str = ""):
        nonlocal pos
        if marks is not None and fmt:
            marks.append((pos, fmt, what))
        out.append(part)
        pos += len(part)

    for key, t, v in m.kvs:
        k = key.decode("utf-8", "replace")
        add(struct.pack("<Q", len(key)), "<Q", f"key length of {k!r}")
        add(key)
        add(struct.pack("<I", t), "<I", f"value type of {k!r}")
        if t == ARRAY and isinstance(v, tuple) and v[0] == STRING:
            add(struct.pack("<I", v[0]), "<I", f"element type of {k!r}")
            add(struct.pack("<Q", len(v[1])), "<Q", f"array length of {k!r}")
            for i, x in enumerate(v[1][:64]):
                add(struct.pack("<Q", len(x)), "<Q", f"string length of {k!r}[{i}]")
                add(x)
            add(b"".join(struct.pack("<Q", len(x)) + x for x in v[1][64:]))
        elif t == ARRAY and isinstance(v, tuple):
            add(struct.pack("<I", v[0]), "<I", f"element type of {k!r}")
            add(struct.pack("<Q", len(v[1])), "<Q", f"array length of {k!r}")
            add(enc_value(t, v)[12:])
        elif t == STRING:
            add(struct.pack("<Q", len(v)), "<Q", f"string length of {k!r}")
            add(v)
        else:
            add(enc_value(t, v))
    for name, ne, tid, off, _ in m.tensors:
        n = name.decode("utf-8", "replace")
        add(struct.pack("<Q", len(name)), "<Q", f"name length of tensor {n!r}")
        add(name)
        add(struct.pack("<I", len(ne)), "<I", f"n_dims of tensor {n!r}")
        for d, x in enumerate(ne):
            add(struct.pack("<Q", x), "<Q", f"ne[{d}] of tensor {n!r}")
        add(struct.pack("<I", tid), "<I", f"type of tensor {n!r}")
        add(struct.pack("<Q", off), "<Q", f"offset of tensor {n!r}")
    hdr = b"".join(out)
    a = max(m.alignment, 1)
    hdr += bytes((-len(hdr)) % a)
    if m.data is None:
        return hdr, len(hdr) + m.data_size
    return hdr + m.data, len(hdr) + len(m.data)


def write(m: Model, path: str, cut: int | None = None) -> int:
    buf, size = serialize(m)
    if cut is not None:
        size = min(size, cut)
        buf = buf[:size]
    with open(path, "wb") as f:
        f.write(buf[:size])
        if size > len(buf):
            f.truncate(size)  # sparse zeros
    return size


def tensor_nbytes(ne, tid):
    try:
        import gguf

        bs, ts = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tid)]
    except (ValueError, KeyError):
        return None
    n = math.prod(ne)
    return None if not ne or ne[0] % bs else n // bs * ts


def relayout(m: Model, rng: random.Random) -> None:
    """Recomputes offsets and data for the current shapes/types (new data random where the
    size changed). Only for seeds that carry their data."""
    if m.data is None:
        return
    a = max(m.alignment, 1)
    data = bytearray()
    for t in m.tensors:
        n = tensor_nbytes(t[1], t[2])
        if n is None or n > 8 << 20:
            continue
        blob = t[4] if t[4] is not None and len(t[4]) == n else rng.randbytes(n)
        data += bytes((-len(data)) % a)
        t[3], t[4] = len(data), blob
        data += blob
    m.data = bytes(data)
    m.data_size = len(data)


# --------------------------------------------------------------------------------------------
# Mutations
# --------------------------------------------------------------------------------------------

SPECIAL_INTS = [0, 1, 2, 3, 7, 8, 16, 31, 32, 64, 255, 256, 4095, 4096, 4097, 65535, 2**24,
                2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**32 + 64, 2**40, 2**62, 2**63 - 1,
                2**63, 2**64 - 1, -1, -2, -2**31, -2**63]
SPECIAL_FLOATS = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 1e-300, 1e38, 1e300,
                  3.4e38, 0.5, 1e6, 1e13]
SPECIAL_STRINGS = [b"", b"\xff\xfe", b"llama", b"qwen2", b"qwen3moe", b"deepseek2", b"gpt2",
                   b"llama-bpe", b"true", b"false", b"\x00", b"a" * 5000, b"\xc3(", b"\xed\xa0\x80",
                   b"{{ 'x' * 3000000000 }}", b"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                   b"{{ '%999999999s' % 1 }}", b"{{ raise_exception('no') }}", b"{% for %}",
                   b"linear", b"yarn", b"none"]
KNOWN_KEYS = [
    "general.architecture", "general.name", "general.alignment", "llama.block_count",
    "llama.context_length", "llama.embedding_length", "llama.feed_forward_length",
    "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
    "llama.attention.value_length", "llama.rope.freq_base", "llama.rope.dimension_count",
    "llama.attention.layer_norm_rms_epsilon", "llama.rope.scaling.type", "llama.rope.scaling.factor",
    "llama.expert_count", "llama.expert_used_count", "llama.expert_feed_forward_length",
    "llama.expert_shared_feed_forward_length", "llama.expert_gating_func",
    "llama.expert_weights_norm", "llama.expert_weights_scale", "llama.expert_group_count",
    "llama.expert_group_used_count", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template",
    "tokenizer.ggml.fim_pad_token_id",
]
TYPE_IDS = [0, 1, 2, 3, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 19, 20, 29, 30, 31, 34, 35, 36, 39,
            40, 100, 255, 2**31, 2**32 - 1]


def rand_scalar(rng: random.Random, t: int):
    if t in (6, 12):
        return rng.choice(SPECIAL_FLOATS) if rng.random() < 0.7 else rng.uniform(-1e6, 1e6)
    if t == STRING:
        return rng.choice(SPECIAL_STRINGS) if rng.random() < 0.7 else rng.randbytes(rng.randint(0, 40))
    lo, hi = INT_RANGES[t]
    cands = [x for x in SPECIAL_INTS if lo <= x <= hi]
    return rng.choice(cands) if rng.random() < 0.7 else rng.randint(lo, hi)


def rand_value(rng: random.Random, t: int, depth: int = 0):
    if t == ARRAY:
        et = rng.choice([0, 4, 5, 6, 7, 8, 10, 11] + ([ARRAY] if depth < 3 else []))
        n = rng.choice([0, 1, 2, 3, 17])
        return et, [rand_value(rng, et, depth + 1) for _ in range(n)]
    if t in FIXED or t == STRING:
        return rand_scalar(rng, t)
    return rng.randbytes(rng.randint(0, 8))  # unknown type id: raw bytes follow


def pick_kv(m: Model, rng: random.Random, prefer_known: float = 0.6):
    if not m.kvs:
        return None
    if rng.random() < prefer_known:
        known = [kv for kv in m.kvs if kv[0].decode("utf-8", "replace") in KNOWN_KEYS]
        if known:
            return rng.choice(known)
    return rng.choice(m.kvs)


def mut_header(m, rng, full):
    which = rng.choice(["version", "n_tensors", "n_kvs"])
    if which == "version":
        m.version = rng.choice([0, 1, 2, 4, 0x03000000, 2**32 - 1, rng.getrandbits(32)])
        return f"version={m.version}"
    real = len(m.tensors) if which == "n_tensors" else len(m.kvs)
    v = rng.choice([0, real - 1, real + 1, real + 2, 2**32, 2**62, 2**64 - 1, rng.getrandbits(64)])
    setattr(m, which, max(v, 0))
    return f"{which}={getattr(m, which)}"


def mut_value(m, rng, full):
    kv = pick_kv(m, rng)
    if kv is None:
        return "noop"
    key = kv[0].decode("utf-8", "replace")
    if kv[1] == ARRAY and rng.random() < 0.7:
        et, items = kv[2]
        op = rng.choice(["trim", "grow", "empty", "elem", "retype", "nest"])
        items = list(items)
        if op == "trim" and items:
            items = items[:rng.randrange(len(items))]
        elif op == "grow":
            items += [rand_value(rng, et) for _ in range(rng.randint(1, 5))] if et in FIXED or et == STRING else []
        elif op == "empty":
            items = []
        elif op == "elem" and items:
            i = rng.randrange(len(items))
            items[i] = rand_value(rng, et)
        elif op == "retype":
            et = rng.choice([0, 1, 4, 5, 6, 7, 8, 10, 11, 12])
            items = [rand_value(rng, et) for _ in range(min(len(items), 50))]
        elif op == "nest":
            et, items = ARRAY, [(et, items[:3]), (et, [])]
        kv[2] = (et, items)
        return f"array {key}: {op} -> {len(items)} x type {et}"
    if rng.random() < 0.5 and (kv[1] in FIXED or kv[1] == STRING):
        kv[2] = rand_scalar(rng, kv[1])
        return f"value {key} = {kv[2]!r:.60}"
    t = rng.choice(list(range(13)) + [13, 99])
    kv[1], kv[2] = t, rand_value(rng, t)
    return f"retype {key} -> type {t} = {kv[2]!r:.60}"


def mut_key(m, rng, full):
    op = rng.choice(["drop", "add", "rename", "dup", "swap", "badkey"])
    if op == "drop" and m.kvs:
        kv = pick_kv(m, rng, 0.8)
        m.kvs.remove(kv)
        return f"drop key {kv[0]!r}"
    if op == "add":
        key = rng.choice(KNOWN_KEYS).encode()
        t = rng.choice([0, 4, 5, 6, 7, 8, 9, 10, 11, 12])
        m.kvs.insert(rng.randint(0, len(m.kvs)), [key, t, rand_value(rng, t)])
        return f"add key {key!r} type {t}"
    if op == "rename" and m.kvs:
        kv = pick_kv(m, rng)
        old = kv[0]
        kv[0] = rng.choice(KNOWN_KEYS).encode()
        return f"rename key {old!r} -> {kv[0]!r}"
    if op == "dup" and m.kvs:
        kv = rng.choice(m.kvs)
        m.kvs.insert(rng.randint(0, len(m.kvs)), list(kv))
        return f"duplicate key {kv[0]!r}"
    if op == "swap" and len(m.kvs) > 1:
        i, j = rng.sample(range(len(m.kvs)), 2)
        m.kvs[i], m.kvs[j] = m.kvs[j], m.kvs[i]
        return f"swap keys {i} {j}"
    if m.kvs:
        kv = rng.choice(m.kvs)
        old = kv[0]
        kv[0] = rng.choice([b"", b"\xff" + old, old[:1] + b"\xc0\x80", rng.randbytes(8), b"a" * 300])
        return f"bad key {old!r} -> {kv[0]!r:.40}"
    return "noop"


def mut_semantic(m, rng, full):
    """A known key set to a hostile value of a plausible type."""
    key = rng.choice(KNOWN_KEYS)
    choices = {
        "general.architecture": (8, [b"llama", b"qwen2", b"qwen3", b"qwen2moe", b"qwen3moe", b"deepseek2",
                                      b"\xffl\xfema", b"", b"mamba"]),
        "general.alignment": (4, [1, 2, 3, 8, 64, 0, 48, 2**31]),
        "llama.rope.scaling.type": (8, [b"linear", b"yarn", b"", b"\xff"]),
        "tokenizer.ggml.add_bos_token": (8, [b"false", b"true", b"no", b""]),
        "tokenizer.ggml.model": (8, [b"gpt2", b"llama", b"bert", b""]),
        "tokenizer.ggml.pre": (8, [b"default", b"llama3", b"qwen2", b"nope", b"\xff"]),
    }
    if key in choices:
        t, vals = choices[key]
        v = rng.choice(vals)
    elif "freq_base" in key or "epsilon" in key or "factor" in key or "scale" in key:
        t, v = rng.choice([6, 12]), rng.choice(SPECIAL_FLOATS)
    elif key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        t, v = ARRAY, (8, [rng.choice(SPECIAL_STRINGS) for _ in range(rng.choice([0, 1, 5, 40]))])
    elif key == "tokenizer.ggml.token_type":
        t, v = ARRAY, (5, [rng.choice([0, 1, 2, 3, 4, 5, 6, 7, -1]) for _ in range(rng.choice([0, 3, 600, 700]))])
    elif key == "tokenizer.chat_template":
        t, v = 8, rng.choice(SPECIAL_STRINGS)
    else:
        t = rng.choice([4, 5, 10, 11])
        lo, hi = INT_RANGES[t]
        v = rng.choice([x for x in SPECIAL_INTS if lo <= x <= hi])
    kv = m.find(key.encode())
    if kv is None:
        m.kvs.append([key.encode(), t, v])
    else:
        kv[1], kv[2] = t, v
    if key == "general.alignment" and t == 4 and v in (1, 2, 8, 64):
        m.alignment = v
        relayout(m, rng)
    return f"semantic {key} = {v!r:.60} (type {t})"


def mut_tensor(m, rng, full):
    if not m.tensors:
        return "noop"
    t = rng.choice(m.tensors)
    name = t[0].decode("utf-8", "replace")
    op = rng.choice(["name", "dim", "ndims", "type", "offset", "drop", "dup", "retype_data",
                     "layer", "swap_shape", "nan_data"])
    if op == "name":
        old = t[0]
        t[0] = rng.choice([b"", b"\xff" + old, old + b"x", b"output.weight", b"token_embd.weight",
                           b"rope_freqs.weight", rng.choice(m.tensors)[0], b"blk.0.ffn_gate_inp.weight"])
        return f"tensor {name}: name -> {t[0]!r}"
    if op == "dim":
        i = rng.randrange(len(t[1]))
        t[1][i] = max(0, rng.choice([0, 1, t[1][i] - 1, t[1][i] + 1, t[1][i] * 2, 2**31, 2**32,
                                     2**63 - 1, 2**64 - 1, rng.getrandbits(64)]))
        return f"tensor {name}: ne[{i}] -> {t[1][i]}"
    if op == "ndims":
        t[1] = (t[1] + [1, 1, 1, 1])[:rng.choice([0, 1, 2, 3, 4, 5, 8])]
        return f"tensor {name}: n_dims -> {len(t[1])}"
    if op == "type":
        t[2] = rng.choice(TYPE_IDS)
        return f"tensor {name}: type -> {t[2]}"
    if op == "offset":
        a = max(m.alignment, 1)
        t[3] = max(0, rng.choice([t[3] + 1, t[3] + a, t[3] - a, 0, m.data_size, m.data_size - a,
                                  2**63, 2**64 - a, rng.choice(m.tensors)[3]]))
        t[3] = min(t[3], 2**64 - 1)
        return f"tensor {name}: offset -> {t[3]}"
    if op == "drop":
        m.tensors.remove(t)
        return f"drop tensor {name}"
    if op == "dup":
        m.tensors.append([t[0], list(t[1]), t[2], t[3], t[4]])
        return f"duplicate tensor {name}"
    if op == "layer":
        parts = t[0].split(b".")
        stem = parts[-2] if len(parts) >= 2 else b"attn_norm"
        t[0] = b"blk.%d.%s.weight" % (rng.choice([2, 3, 99, 4095, 4096, 10**12]), stem)
        return f"tensor {name}: renamed {t[0]!r}"
    if op == "swap_shape" and len(m.tensors) > 1:
        u = rng.choice(m.tensors)
        t[1], u[1] = u[1], t[1]
        if full:
            relayout(m, rng)
        return f"swap shapes {name} <-> {u[0]!r}"
    if op == "retype_data" and full:
        t[2] = rng.choice([0, 1, 8, 2, 3, 12, 14, 30, 16])  # F32 F16 Q8_0 Q4_0 Q4_1 Q4_K Q6_K BF16 IQ2_XXS
        relayout(m, rng)
        return f"tensor {name}: retyped to {t[2]} with random data"
    if op == "nan_data" and full and t[4] and t[2] == 0:
        vals = [math.nan, math.inf, -math.inf, 1e38, -1e38, 0.0]
        n = len(t[4]) // 4
        t[4] = struct.pack("<%df" % n, *[rng.choice(vals) for _ in range(n)])
        relayout(m, rng)
        return f"tensor {name}: data set to NaN/inf/huge"
    return "noop"


def mut_alignment(m, rng, full):
    v = rng.choice([1, 2, 4, 8, 64, 128, 3, 0, 2**31])
    kv = m.find(b"general.alignment")
    if kv is None:
        m.kvs.append([b"general.alignment", 4, v])
    else:
        kv[1], kv[2] = 4, v
    if v & (v - 1) == 0 and 0 < v <= 4096 and full:
        m.alignment = v
        relayout(m, rng)
        return f"alignment {v} (relaid out)"
    return f"alignment {v}"


MODEL_MUTATIONS = [(mut_header, 1), (mut_value, 5), (mut_key, 2), (mut_semantic, 6),
                   (mut_tensor, 3), (mut_alignment, 1)]


def field_mutation(buf: bytearray, rng: random.Random, marks: list) -> str:
    """A count, length, type or offset field of the serialised file set to a hostile value,
    whatever follows it (the reader must not trust it)."""
    at, fmt, what = rng.choice(marks)
    old = struct.unpack_from(fmt, buf, at)[0]
    top = 2**32 - 1 if fmt == "<I" else 2**64 - 1
    new = rng.choice([0, 1, old + 1, old - 1, old * 2, old + 8, top, top >> 1, (top >> 1) + 1,
                      13, 99, rng.getrandbits(32 if fmt == "<I" else 64)])
    new = min(max(new, 0), top)
    struct.pack_into(fmt, buf, at, new)
    return f"field {what} at byte {at}: {old} -> {new}"


def raw_mutation(buf: bytearray, rng: random.Random, header_end: int) -> str:
    op = rng.choice(["flip", "special", "insert", "delete", "u64"])
    hi = max(header_end, 25)
    if op == "flip":
        descr = []
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(hi)
            buf[i] ^= 1 << rng.randrange(8)
            descr.append(i)
        return f"flip bits at {descr}"
    if op == "special":
        i = rng.randrange(hi)
        buf[i] = rng.choice([0, 0xFF, 0x7F, 0x80, 1, 9, 13])
        return f"byte {i} = {buf[i]}"
    if op == "insert":
        i = rng.randrange(hi)
        buf[i:i] = rng.randbytes(rng.randint(1, 16))
        return f"insert at {i}"
    if op == "delete":
        i = rng.randrange(hi)
        del buf[i:i + rng.randint(1, 16)]
        return f"delete at {i}"
    i = rng.randrange(max(hi - 8, 1))
    buf[i:i + 8] = struct.pack("<Q", rng.choice([0, 2**64 - 1, 2**63, 2**32, 1 << 40]))
    return f"u64 at {i}"


def make_mutant(seed_model: Model, rng: random.Random, full: bool, path: str) -> list[str]:
    """Writes one mutant of seed_model to path; returns its recipe."""
    m = seed_model.copy()
    recipe = []
    funcs, weights = zip(*MODEL_MUTATIONS)
    for _ in range(rng.choice([1, 1, 2, 3])):
        recipe.append(rng.choices(funcs, weights)[0](m, rng, full))
    r = rng.random()
    if r < 0.25:  # byte-level: havoc on the serialised header, or one field set raw
        marks: list = []
        buf, size = serialize(m, marks)
        hdr_len = len(buf) - (len(m.data) if m.data is not None else 0)
        b = bytearray(buf)
        if r < 0.12 and marks:
            recipe.append(field_mutation(b, rng, marks))
        else:
            recipe.append(raw_mutation(b, rng, hdr_len))
        with open(path, "wb") as f:
            f.write(b)
            if m.data is None:
                f.truncate(len(b) + m.data_size)
        return recipe
    cut = None
    if r < 0.32:
        _, size = serialize(m)
        cut = rng.choice([rng.randrange(size), size - 1, size // 2, rng.randrange(min(size, 4096))])
        recipe.append(f"truncate to {cut} of {size} bytes")
    write(m, path, cut)
    return recipe


# --------------------------------------------------------------------------------------------
# Checking one mutant (in the child)
# --------------------------------------------------------------------------------------------

PASS_TYPES = (ValueError, MemoryError)


def check_mutant(path: str, full: bool) -> dict:
    """Runs every consumer on the file; returns {"steps": {...}, "fail": None | message}."""
    from tensorfold import _core
    from tensorfold.chat_template import render_chat
    from tensorfold.info import describe
    from tensorfold.tokenizer import Tokenizer

    steps = {}
    fail = None

    def step(name, fn):
        nonlocal fail
        try:
            out = fn()
            steps[name] = "ok"
            return out, True
        except PASS_TYPES as e:
            if not str(e).strip():
                fail = fail or f"{name}: {type(e).__name__} with an empty message"
            steps[name] = "refused"
            return None, False
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - everything else is a finding
            fail = fail or f"{name}: {type(e).__name__}: {str(e)[:300]}"
            steps[name] = "FAIL"
            return None, False

    f, ok = step("open", lambda: _core.GgufFile(path))
    if ok:
        md, ok = step("metadata", f.metadata)
        if ok:
            def touch():
                for v in md.values():
                    if hasattr(v, "tolist"):
                        v.tolist()

            step("touch", touch)
            tok, ok = step("tokenizer", lambda: Tokenizer.from_gguf_metadata(md))
            if ok:
                step("encode", lambda: tok.decode(tok.encode("Hello world 123, <|im_end|> héllo")))
            step("chat_template", lambda: render_chat(
                md.get("tokenizer.chat_template"), [{"role": "user", "content": "hi"}],
                bos_token="<s>", eos_token="</s>"))
        step("check_unchanged", lambda: f.check_unchanged())
    step("info", lambda: describe(path))
    if full:
        def engine():
            e = _core.Engine(path, 1, 64, 64)
            n = e.config["n_vocab"]
            e.logits([i % n for i in (1, 2, 3)])

        step("engine", engine)
    return {"steps": steps, "fail": fail}


# --------------------------------------------------------------------------------------------
# Child process: runs a list of cases, reporting each start and result on stdout
# --------------------------------------------------------------------------------------------

RSS_LIMIT = 1 << 30


def case_plan(master_seed: int, case: int, n_tiny_share: float = 0.75):
    rng = random.Random(f"tensorfold-fuzz-{master_seed}-{case}")
    kind = "tiny" if rng.random() < n_tiny_share else "smollm"
    return rng, kind


def child_main() -> None:
    import warnings

    warnings.simplefilter("ignore")
    if "asan" not in os.environ.get("LD_PRELOAD", ""):  # ASan reserves terabytes of address space
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a runaway cannot take the machine
    cfg = json.loads(sys.stdin.readline())
    seeds = {}
    with open(cfg["tiny"], "rb") as fh:
        seeds["tiny"] = parse(fh.read())
    if cfg.get("smollm_header"):
        with open(cfg["smollm_header"], "rb") as fh:
            seeds["smollm"] = parse(fh.read(), data=False)
        seeds["smollm"].data = None
        seeds["smollm"].data_size = cfg["smollm_data_size"]
    path = os.path.join(cfg["workdir"], f"mutant-{os.getpid()}.gguf")
    for case in cfg["cases"]:
        rng, kind = case_plan(cfg["seed"], case)
        if kind not in seeds:
            kind = "tiny"
        recipe = make_mutant(seeds[kind], rng, kind == "tiny", path)
        print(json.dumps({"start": case, "kind": kind, "recipe": recipe}), flush=True)
        try:
            r = check_mutant(path, kind == "tiny")
        except Exception as e:  # a bug of the harness itself, not of the code under test
            r = {"steps": {}, "fail": f"harness error: {type(e).__name__}: {e}"}
        if cfg.get("selftest"):  # the harness's own test: planted failures
            planted = cfg["selftest"].get(str(case))
            if planted == "crash":
                os.abort()
            elif planted == "hang":  # a busy loop: found by its CPU time, whatever the load
                while True:
                    pass
            elif planted == "deadlock":  # no CPU use: found by the wall-clock limit
                time.sleep(3600)
            elif planted == "slow":  # longer than the CPU budget in wall time only
                time.sleep(6)
            elif planted == "typeerror":
                r["fail"] = "planted: TypeError"
            elif planted == "memory":
                blob = bytearray(1200 << 20)  # touched: counts in RSS
                blob[::4096] = b"x" * len(blob[::4096])
        rss = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
        if rss > RSS_LIMIT:
            r["fail"] = r["fail"] or f"peak RSS {rss >> 20} MiB > {RSS_LIMIT >> 20} MiB"
        r["done"] = case
        r["kind"] = kind
        print(json.dumps(r), flush=True)
        if rss > RSS_LIMIT:
            return  # the peak is per process: go on in a fresh one
    print(json.dumps({"finished": True}), flush=True)


# --------------------------------------------------------------------------------------------
# Parent: runs the cases in a few child processes, pinpoints crashes and hangs
# --------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a live process has used so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Runner:
    def __init__(self, cfg: dict, workers: int, case_timeout: float, wall_timeout: float | None = None):
        self.cfg = cfg
        self.workers = workers
        self.case_timeout = case_timeout  # CPU seconds a case may use
        self.wall_timeout = wall_timeout or max(300.0, 10 * case_timeout)
        self.results: dict[int, dict] = {}
        self.findings: list[dict] = []
        self.keep = os.environ.get("TENSORFOLD_FUZZ_KEEP")

    def _spawn(self, cases):
        env = dict(os.environ)
        env["PYTHONFAULTHANDLER"] = "1"  # a crashing child prints the Python stack
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env)
        cfg = dict(self.cfg, cases=cases)
        p.stdin.write((json.dumps(cfg) + "\n").encode())
        p.stdin.close()
        return {"proc": p, "cases": list(cases), "buf": b"", "current": None, "since": time.monotonic(),
                "err": b""}

    def _record(self, case, kind, recipe, what, detail=""):
        f = {"case": case, "kind": kind, "recipe": recipe, "failure": what, "detail": detail}
        if self.keep:  # the mutant itself: `python tests/test_fuzz_gguf.py --make ...`
            os.makedirs(self.keep, exist_ok=True)
            f["kept"] = os.path.join(self.keep, f"case-{case}.recipe.json")
            with open(f["kept"], "w") as fh:
                json.dump(f, fh)
        self.findings.append(f)

    def run(self, cases: list[int]) -> None:
        chunks = [cases[i::self.workers] for i in range(self.workers)]
        live = [self._spawn(c) for c in chunks if c]
        while live:
            fds = {w["proc"].stdout.fileno(): w for w in live}
            fds.update({w["proc"].stderr.fileno(): w for w in live})
            ready, _, _ = select.select(list(fds), [], [], 1.0)
            for fd in ready:
                w = fds[fd]
                data = os.read(fd, 1 << 16)
                if fd == w["proc"].stderr.fileno():
                    w["err"] = (w["err"] + data)[-8000:]
                    continue
                if not data:
                    continue
                w["buf"] += data
                while b"\n" in w["buf"]:
                    line, w["buf"] = w["buf"].split(b"\n", 1)
                    self._message(w, json.loads(line))
            for w in list(live):
                p = w["proc"]
                hang = None
                if w["current"] is not None:
                    cpu = cpu_seconds(p.pid) - w["cpu_since"]
                    wall = time.monotonic() - w["since"]
                    if cpu > self.case_timeout:
                        hang = f"no result after {cpu:.0f} s of CPU time"
                    elif wall > self.wall_timeout:
                        hang = f"no result after {wall:.0f} s"
                if hang:
                    p.kill()
                    p.wait()
                    c = w["current"]
                    self._record(c["start"], c["kind"], c["recipe"], "hang", hang)
                    self._restart(w, live, c["start"])
                elif p.poll() is not None:
                    self._finish(w, live)

    def _message(self, w, msg):
        if "start" in msg:
            w["current"] = msg
            w["since"] = time.monotonic()
            w["cpu_since"] = cpu_seconds(w["proc"].pid)
        elif "done" in msg:
            c = w["current"]
            self.results[msg["done"]] = msg
            if msg["fail"]:
                self._record(c["start"], c["kind"], c["recipe"], msg["fail"], json.dumps(msg["steps"]))
            w["cases"].remove(msg["done"])
            w["current"] = None
        elif msg.get("finished"):
            w["finished"] = True

    def _finish(self, w, live):
        p = w["proc"]
        rest = w["buf"] + p.stdout.read()
        w["buf"] = b""
        for line in rest.splitlines():
            self._message(w, json.loads(line))
        w["err"] = (w["err"] + p.stderr.read())[-8000:]
        live.remove(w)
        if w.get("finished") and not w["cases"]:
            return
        c = w["current"]
        if c is not None:  # died inside a case: that case crashed
            self._record(c["start"], c["kind"], c["recipe"], f"crash (exit status {p.returncode})",
                         w["err"].decode("utf-8", "replace")[-3000:])
            w["cases"].remove(c["start"])
        elif w["cases"] and p.returncode != 0:
            raise RuntimeError(f"fuzz child failed outside a case: {w['err'].decode('utf-8', 'replace')}")
        if w["cases"]:
            live.append(self._spawn(w["cases"]))

    def _restart(self, w, live, case):
        live.remove(w)
        w["cases"].remove(case)
        if w["cases"]:
            live.append(self._spawn(w["cases"]))


def prepare_seeds(workdir: str, smollm2_path: str) -> dict:
    from test_metadata_validation import tiny_llama_spec, tokenizer_metadata, write_gguf

    from tensorfold import _core

    tiny = write_gguf(os.path.join(workdir, "seed-tiny.gguf"), *tiny_llama_spec(tokenizer_metadata(smollm2_path)))
    f = _core.GgufFile(smollm2_path)
    with open(smollm2_path, "rb") as fh:
        header = fh.read(f.data_offset)
    hpath = os.path.join(workdir, "seed-smollm-header.gguf")
    with open(hpath, "wb") as fh:
        fh.write(header)
    return {"tiny": tiny, "smollm_header": hpath, "smollm_data_size": f.file_size - f.data_offset}


def run_fuzz(smollm2_path: str, n_cases: int, seed: int, workers: int = 2,
             case_timeout: float = 60.0, selftest: dict | None = None,
             wall_timeout: float | None = None) -> tuple[dict, list]:
    with tempfile.TemporaryDirectory(prefix="tf-fuzz-") as d:
        cfg = dict(prepare_seeds(d, smollm2_path), workdir=d, seed=seed, selftest=selftest)
        r = Runner(cfg, workers, case_timeout, wall_timeout)
        t = time.monotonic()
        r.run(list(range(n_cases)))
        stats = {"cases": n_cases, "seconds": round(time.monotonic() - t, 1),
                 "findings": len(r.findings)}
        by_step: dict[str, dict[str, int]] = {}
        stats["kinds"] = {}
        for res in r.results.values():
            stats["kinds"][res["kind"]] = stats["kinds"].get(res["kind"], 0) + 1
            for s, outcome in res["steps"].items():
                by_step.setdefault(s, {}).setdefault(outcome, 0)
                by_step[s][outcome] += 1
        stats["steps"] = by_step
        return stats, r.findings


def _report(findings) -> str:
    return "\n".join(f"case {f['case']} ({f['kind']}): {f['failure']}\n  recipe: {f['recipe']}\n"
                     f"  {f['detail'][-1500:]}" for f in findings)


def _env_int(name, default):
    v = os.environ.get(name)
    return int(v) if v else default


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


def test_model_roundtrip_is_byte_exact(tmp_path, smollm2_path):
    """The fuzzer's serialiser reproduces the gguf package's files exactly, so every mutant
    differs from a valid file only by its recipe."""
    from test_metadata_validation import tiny_llama_spec, tokenizer_metadata, write_gguf

    path = write_gguf(tmp_path / "tiny.gguf", *tiny_llama_spec(tokenizer_metadata(smollm2_path)))
    buf = open(path, "rb").read()
    assert serialize(parse(buf))[0] == buf
    marks: list = []
    assert serialize(parse(buf), marks)[0] == buf
    # the marked fields are where the file says they are
    marked = {what: struct.unpack_from(fmt, buf, at)[0] for at, fmt, what in marks}
    assert marked["array length of 'tokenizer.ggml.tokens'"] == 600
    assert marked["n_dims of tensor 'token_embd.weight'"] == 2
    assert marked["ne[1] of tensor 'token_embd.weight'"] == 600
    assert marked["value type of 'llama.block_count'"] == 4
    from tensorfold import _core

    n = _core.GgufFile(smollm2_path).data_offset
    with open(smollm2_path, "rb") as fh:
        head = fh.read(n + 4096)
    m = parse(head, data=False)
    m.data = None
    m.data_size = os.path.getsize(smollm2_path) - n
    out, size = serialize(m)
    assert out == head[:n] and size == os.path.getsize(smollm2_path)


def test_fuzz_harness_reports_crash_hang_error_and_memory(smollm2_path):
    """Failures planted in the child are each pinned to their case, and the other cases still
    run (in fresh children). The hang is a busy loop, caught by its CPU time: a loaded machine
    stretches the wall time of the working cases but not their CPU time, so none of them can
    be taken for a hang (this test once failed that way with a 5 s wall-clock limit)."""
    planted = {"3": "crash", "6": "hang", "9": "typeerror", "12": "memory"}
    # 15 s of CPU per case: the memory case faults in 1.2 GB after its forward, which on a
    # loaded VM has taken more than 5 s of (system) CPU time and was then taken for a hang.
    stats, findings = run_fuzz(smollm2_path, 16, seed=7, workers=2, case_timeout=15.0,
                               selftest=planted)
    got = {f["case"]: f["failure"] for f in findings}
    assert sorted(got) == [3, 6, 9, 12], got
    assert got[3].startswith("crash") and "-6" in got[3]
    assert got[6] == "hang"
    assert got[9] == "planted: TypeError"
    assert got[12].startswith("peak RSS")
    assert sum(stats["kinds"].values()) == 16 - 2  # all but the crash and the hang reported


def test_fuzz_harness_counts_cpu_time_not_wall_time(smollm2_path):
    """A case that takes longer than its CPU budget in wall time while using little CPU (as a
    working case does on a loaded machine) is not a hang; a case that never ends without using
    CPU (a deadlock) is caught by the wall-clock limit."""
    stats, findings = run_fuzz(smollm2_path, 4, seed=7, workers=1, case_timeout=5.0, wall_timeout=12.0,
                               selftest={"1": "slow", "2": "deadlock"})
    got = {f["case"]: f for f in findings}
    assert sorted(got) == [2], got
    assert got[2]["failure"] == "hang" and "CPU" not in got[2]["detail"]  # the wall-clock limit
    assert sum(stats["kinds"].values()) == 3  # the slow case reported its result


def test_fuzz_gguf(smollm2_path):
    n = _env_int("TENSORFOLD_FUZZ_CASES", 300)
    stats, findings = run_fuzz(smollm2_path, n, _env_int("TENSORFOLD_FUZZ_SEED", 1))
    print("\nfuzz stats:", json.dumps(stats, sort_keys=True))
    assert not findings, f"{len(findings)} findings:\n{_report(findings)}"
    steps = stats["steps"]
    # the mutants reach every consumer, and the valid-enough ones get through it
    assert steps["open"].get("ok", 0) > n // 4 and steps["open"].get("refused", 0) > n // 10
    for s in ("tokenizer", "chat_template", "info", "engine"):
        assert steps[s].get("ok", 0) > 0 and steps[s].get("refused", 0) > 0, (s, steps[s])


@pytest.mark.slow
def test_fuzz_gguf_slow(smollm2_path):
    n = _env_int("TENSORFOLD_FUZZ_CASES", 5000)
    stats, findings = run_fuzz(smollm2_path, n, _env_int("TENSORFOLD_FUZZ_SEED", 2))
    print("\nfuzz stats:", json.dumps(stats, sort_keys=True))
    assert not findings, f"{len(findings)} findings:\n{_report(findings)}"


def make_case(smollm2_path: str, case: int, seed: int, out: str) -> list[str]:
    """Rebuilds the mutant of one case (for reproducing a finding): returns its recipe."""
    with tempfile.TemporaryDirectory(prefix="tf-fuzz-") as d:
        cfg = prepare_seeds(d, smollm2_path)
        rng, kind = case_plan(seed, case)
        if kind == "tiny":
            with open(cfg["tiny"], "rb") as fh:
                m = parse(fh.read())
        else:
            with open(cfg["smollm_header"], "rb") as fh:
                m = parse(fh.read(), data=False)
            m.data, m.data_size = None, cfg["smollm_data_size"]
        return make_mutant(m, rng, kind == "tiny", out)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1:] == ["--child"]:
        child_main()
    elif sys.argv[1:2] == ["--make"]:  # --make SMOLLM2_GGUF CASE SEED OUT
        print(make_case(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
