"""GGUF reader: valid files read back exactly as the `gguf` package's GGUFReader (the oracle)
reads them; corrupt, truncated and hostile files raise ValueError naming the problem."""
from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from tensorfold import _core  # noqa: E402

GgufFile = _core.GgufFile
VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

# --------------------------------------------------------------------------------------------
# A tiny test-local header walker: byte offsets of every field, to patch corruptions into
# otherwise valid files.
# --------------------------------------------------------------------------------------------

_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
          10: "<Q", 11: "<q", 12: "<d"}


def walk(buf: bytes) -> dict:
    pos = 0

    def u32():
        nonlocal pos
        v = struct.unpack_from("<I", buf, pos)[0]
        pos += 4
        return v

    def u64():
        nonlocal pos
        v = struct.unpack_from("<Q", buf, pos)[0]
        pos += 8
        return v

    def string():
        nonlocal pos
        at = pos
        n = u64()
        s = buf[pos:pos + n]
        pos += n
        return at, s

    def value(t, info):
        nonlocal pos
        if t == 8:
            info.setdefault("str_len_off", pos)
            string()
        elif t == 9:
            et_off = pos
            et = u32()
            cnt_off = pos
            n = u64()
            info.setdefault("elem_type_off", et_off)
            info.setdefault("count_off", cnt_off)
            for _ in range(n):
                value(et, {})
        else:
            pos += struct.calcsize(_FIXED[t])

    pos = 4
    out = {"version_off": 4}
    out["version"] = u32()
    out["tensor_count_off"] = pos
    tc = u64()
    out["kv_count_off"] = pos
    kc = u64()
    kvs = {}
    for _ in range(kc):
        key_off, key = string()
        type_off = pos
        t = u32()
        info = {"key_off": key_off, "type_off": type_off, "value_off": pos, "type": t}
        value(t, info)
        kvs[key.decode()] = info
    out["kvs"] = kvs
    tensors = {}
    for _ in range(tc):
        name_off, name = string()
        ti = {"name_off": name_off, "ndims_off": pos}
        nd = u32()
        ti["dims_off"] = [pos + 8 * i for i in range(nd)]
        ti["dims"] = [u64() for _ in range(nd)]
        ti["type_off"] = pos
        ti["type"] = u32()
        ti["offset_off"] = pos
        ti["offset"] = u64()
        tensors[name.decode()] = ti
    out["tensors"] = tensors
    out["header_end"] = pos
    align = 32
    if "general.alignment" in kvs:
        align = struct.unpack_from("<I", buf, kvs["general.alignment"]["value_off"])[0]
    out["data_off"] = (pos + align - 1) // align * align
    return out


def patch(buf: bytes, off: int, fmt: str, value) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


# --------------------------------------------------------------------------------------------
# Valid files
# --------------------------------------------------------------------------------------------

NESTED = [[1, 2, 3], [-4]]
NESTED2 = [["a", "b"], ["c"]]


def _write(path, fill):
    w = gguf.GGUFWriter(str(path), arch="testarch")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _rand_bytes(rng, n):
    return rng.integers(0, 256, size=n, dtype=np.uint8)


def write_full(path) -> tuple[str, dict]:
    """Every metadata value type and a spread of tensor types. Returns (path, tensor bytes)."""
    rng = np.random.default_rng(0)
    tensors = {}

    def fill(w):
        w.add_uint8("v.u8", 250)
        w.add_int8("v.i8", -100)
        w.add_uint16("v.u16", 65000)
        w.add_int16("v.i16", -32000)
        w.add_uint32("v.u32", 4_000_000_000)
        w.add_int32("v.i32", -2_000_000_000)
        w.add_float32("v.f32", 0.1)
        w.add_bool("v.bool_t", True)
        w.add_bool("v.bool_f", False)
        w.add_string("v.str", "héllo ✓ wörld")
        w.add_key_value("v.empty_str", "", VT.STRING)
        w.add_uint64("v.u64", 2**63 + 5)
        w.add_int64("v.i64", -(2**62))
        w.add_float64("v.f64", math.pi)
        w.add_key_value("v.arr_u8", [1, 2, 255], VT.ARRAY, sub_type=VT.UINT8)
        w.add_key_value("v.arr_i16", [-1, 2, -300], VT.ARRAY, sub_type=VT.INT16)
        w.add_key_value("v.arr_u64", [0, 2**64 - 1], VT.ARRAY, sub_type=VT.UINT64)
        w.add_key_value("v.arr_i64", [-(2**63), 2**63 - 1], VT.ARRAY, sub_type=VT.INT64)
        w.add_array("v.arr_i32", [1, -2, 3])
        w.add_array("v.arr_f32", [0.5, -1.25, 3.0e8])
        w.add_key_value("v.arr_f64", [math.e, -0.0], VT.ARRAY, sub_type=VT.FLOAT64)
        w.add_array("v.arr_bool", [True, False, True])
        w.add_array("v.arr_str", ["a", "", "ünï", "tok" * 50])
        w.add_array("v.nested", NESTED)
        w.add_array("v.nested_str", NESTED2)
        specs = [
            ("t.f32", QT.F32, (3, 5)),
            ("t.f16", QT.F16, (7,)),
            ("t.bf16", QT.BF16, (2, 4)),
            ("t.q4_0", QT.Q4_0, (2, 64)),
            ("t.q8_0", QT.Q8_0, (3, 32)),
            ("t.q4_k", QT.Q4_K, (1, 256)),
            ("t.q6_k", QT.Q6_K, (2, 1, 256)),
            ("t.iq2_xxs", QT.IQ2_XXS, (1, 256)),
            ("t.nvfp4", QT.NVFP4, (1, 64)),  # known layout, no kernels: opens, unsupported
        ]
        for name, qt, shape in specs:
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            row = shape[-1] // bs * ts
            data = _rand_bytes(rng, int(np.prod(shape[:-1], dtype=np.int64)) * row)
            data = data.reshape(*shape[:-1], row)
            tensors[name] = data.tobytes()
            w.add_tensor(name, data, raw_dtype=qt)

    return _write(path, fill), tensors


def write_small(path) -> str:
    """Small file with an explicit general.alignment and a few patchable fields."""

    def fill(w):
        w.add_custom_alignment(32)
        w.add_string("s.name", "small")
        w.add_bool("s.flag", True)
        w.add_uint32("k.a", 1)
        w.add_uint32("k.b", 2)
        w.add_array("s.arr", [1, 2, 3, 4])
        w.add_array("s.strs", ["x", "yy"])
        w.add_tensor("w0", np.arange(8, dtype=np.float32))
        w.add_tensor("w1", np.zeros((2, 18), dtype=np.uint8), raw_dtype=QT.Q4_0)
        w.add_tensor("w2", np.arange(16, dtype=np.float32).reshape(2, 8))

    return _write(path, fill)


def oracle_metadata(path) -> dict:
    r = gguf.GGUFReader(path)
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        if f.types[0] == VT.ARRAY and len(f.types) > 2:
            out[name] = NotImplemented  # GGUFReader cannot unflatten nested arrays
        else:
            out[name] = f.contents()
    return out, r


# numpy dtype each numeric GGUF array type must come out as
_NP_DTYPES = {VT.UINT8: np.uint8, VT.INT8: np.int8, VT.UINT16: np.uint16, VT.INT16: np.int16,
              VT.UINT32: np.uint32, VT.INT32: np.int32, VT.FLOAT32: np.float32,
              VT.UINT64: np.uint64, VT.INT64: np.int64, VT.FLOAT64: np.float64, VT.BOOL: np.bool_}


def plain(v):
    """A metadata value with arrays (numpy / GgufArray) turned into Python lists."""
    return v.tolist() if isinstance(v, (np.ndarray, _core.GgufArray)) else v


def assert_same_as_oracle(path):
    f = GgufFile(path)
    ours = f.metadata()
    theirs, r = oracle_metadata(path)
    assert list(ours.keys()) == list(theirs.keys())
    for k, v in theirs.items():
        if v is NotImplemented:
            continue
        field = r.fields[k]
        if field.types[0] == VT.ARRAY:
            et = field.types[1] if len(field.types) > 1 else None
            if et in _NP_DTYPES:
                assert isinstance(ours[k], np.ndarray), k
                assert ours[k].dtype == _NP_DTYPES[et], (k, ours[k].dtype)
                assert not ours[k].flags.writeable
            else:
                assert isinstance(ours[k], _core.GgufArray), k
                assert len(ours[k]) == len(v)
        mine = plain(ours[k])
        assert mine == v, k
        assert type(mine) is type(v), (k, type(mine), type(v))
        if isinstance(v, list):
            for a, b in zip(mine, v):
                assert type(a) is type(b), k
    ts = f.tensors()
    assert len(ts) == len(r.tensors)
    for ours_t, rt in zip(ts, r.tensors):
        assert ours_t["name"] == rt.name
        assert ours_t["type_id"] == int(rt.tensor_type)
        assert ours_t["type"] == rt.tensor_type.name
        assert ours_t["shape"] == [int(x) for x in rt.shape]
        assert ours_t["offset"] == rt.data_offset
        assert ours_t["nbytes"] == rt.n_bytes
        assert f.tensor_data(rt.name).tobytes() == np.asarray(rt.data).tobytes()
    return f


def test_all_value_types_and_tensors(tmp_path):
    path, tensors = write_full(tmp_path / "full.gguf")
    f = assert_same_as_oracle(path)
    md = f.metadata()
    assert f.version == 3
    assert f.alignment == 32
    assert f.data_offset % 32 == 0
    assert f.file_size == (tmp_path / "full.gguf").stat().st_size
    assert f.path == path
    # values and Python types
    assert md["general.architecture"] == "testarch"
    assert md["v.u8"] == 250 and md["v.i8"] == -100
    assert md["v.u16"] == 65000 and md["v.i16"] == -32000
    assert md["v.u32"] == 4_000_000_000 and md["v.i32"] == -2_000_000_000
    assert md["v.u64"] == 2**63 + 5 and md["v.i64"] == -(2**62)
    assert md["v.f32"] == float(np.float32(0.1)) and isinstance(md["v.f32"], float)
    assert md["v.f64"] == math.pi
    assert md["v.bool_t"] is True and md["v.bool_f"] is False
    assert md["v.str"] == "héllo ✓ wörld" and md["v.empty_str"] == ""
    assert md["v.arr_u64"].dtype == np.uint64 and md["v.arr_u64"].tolist() == [0, 2**64 - 1]
    assert md["v.arr_i64"].dtype == np.int64 and md["v.arr_i64"].tolist() == [-(2**63), 2**63 - 1]
    assert md["v.arr_u8"].dtype == np.uint8 and md["v.arr_u8"].tolist() == [1, 2, 255]
    assert md["v.arr_i16"].dtype == np.int16 and md["v.arr_i16"].tolist() == [-1, 2, -300]
    assert md["v.arr_f32"].dtype == np.float32
    assert md["v.arr_f32"].tolist() == [0.5, -1.25, float(np.float32(3.0e8))]
    assert md["v.arr_f64"].dtype == np.float64 and md["v.arr_f64"].tolist() == [math.e, -0.0]
    assert md["v.arr_bool"].dtype == np.bool_ and md["v.arr_bool"].tolist() == [True, False, True]
    assert all(type(x) is bool for x in md["v.arr_bool"].tolist())
    # string arrays and nested arrays: lazy sequences, equal to the lists they hold
    strs = md["v.arr_str"]
    assert isinstance(strs, _core.GgufArray) and strs.elem_type == "string"
    assert strs == ["a", "", "ünï", "tok" * 50] and strs.tolist() == ["a", "", "ünï", "tok" * 50]
    assert len(strs) == 4 and strs[2] == "ünï" and strs[-1] == "tok" * 50
    assert strs[1:3] == ["", "ünï"] and strs[::-2] == ["tok" * 50, ""]
    assert list(strs) == ["a", "", "ünï", "tok" * 50] and "ünï" in strs
    with pytest.raises(IndexError):
        strs[4]
    nested = md["v.nested"]
    assert isinstance(nested, _core.GgufArray) and nested.elem_type == "array"
    assert nested == NESTED and nested.tolist() == NESTED
    assert nested[0].dtype == np.int32 and nested[0].tolist() == NESTED[0]  # inner: numpy
    assert md["v.nested_str"] == NESTED2 and md["v.nested_str"][1] == ["c"]
    assert repr(nested) == "GgufArray(array, 2 elements)"
    # get
    assert f.get("v.u8") == 250
    assert f.get("nope") is None and f.get("nope", 7) == 7
    assert "v.u8" in f and "nope" not in f
    # tensors
    ts = {t["name"]: t for t in f.tensors()}
    assert list(ts) == list(tensors)
    assert ts["t.f32"]["shape"] == [5, 3] and ts["t.f32"]["type"] == "F32"
    assert ts["t.q6_k"]["shape"] == [256, 1, 2] and ts["t.q6_k"]["type"] == "Q6_K"
    assert ts["t.q4_k"]["supported"] is True
    assert ts["t.iq2_xxs"]["supported"] is True and ts["t.iq2_xxs"]["type"] == "IQ2_XXS"
    assert ts["t.nvfp4"]["supported"] is False and ts["t.nvfp4"]["type"] == "NVFP4"
    for name, data in tensors.items():
        t = ts[name]
        assert t["nbytes"] == len(data)
        assert t["offset"] % 32 == 0 and t["offset"] >= f.data_offset
        arr = f.tensor_data(name)
        assert arr.dtype == np.uint8 and arr.shape == (len(data),)
        assert arr.tobytes() == data
    with pytest.raises(KeyError):
        f.tensor_data("missing")


def test_typed_getters(tmp_path):
    path, _ = write_full(tmp_path / "full.gguf")
    f = GgufFile(path)
    assert f.get_int("v.u8") == 250
    assert f.get_int("v.i64") == -(2**62)
    assert f.get_int("v.bool_t") == 1
    assert f.get_int("missing", 5) == 5
    assert f.get_float("v.f32") == pytest.approx(0.1)
    assert f.get_float("v.u32") == 4e9
    assert f.get_float("missing", 2.5) == 2.5
    assert f.get_string("v.str") == "héllo ✓ wörld"
    assert f.get_bool("v.bool_t", False) is True
    assert f.get_bool("missing", True) is True
    with pytest.raises(ValueError, match=r"'v\.str'.*string.*integer"):
        f.get_int("v.str")
    with pytest.raises(ValueError, match=r"'v\.u64'.*int64"):
        f.get_int("v.u64")
    with pytest.raises(ValueError, match=r"'missing'.*missing"):
        f.get_int("missing")
    with pytest.raises(ValueError, match=r"'v\.arr_str'.*array\[string\].*float"):
        f.get_float("v.arr_str")
    with pytest.raises(ValueError, match=r"'v\.u8'.*uint8.*string"):
        f.get_string("v.u8")


def test_tensor_data_is_zero_copy_view_keeping_file_alive(tmp_path):
    path, tensors = write_full(tmp_path / "full.gguf")
    f = GgufFile(path)
    a = f.tensor_data("t.q4_0")
    b = f.tensor_data("t.q4_0")
    assert a.ctypes.data == b.ctypes.data  # same mapping, no copy
    assert not a.flags.writeable and not a.flags.owndata
    with pytest.raises(ValueError):
        a[0] = 1
    del f, b
    import gc

    gc.collect()
    assert a.tobytes() == tensors["t.q4_0"]  # the array keeps the mapping alive


def test_small_file_matches_oracle(tmp_path):
    path = write_small(tmp_path / "small.gguf")
    assert_same_as_oracle(path)


def test_no_tensors(tmp_path):
    path = _write(tmp_path / "empty.gguf", lambda w: w.add_string("x", "y"))
    f = GgufFile(path)
    assert f.tensors() == [] and f.metadata()["x"] == "y"


def test_invalid_utf8_is_replaced(tmp_path):
    path = write_small(tmp_path / "small.gguf")
    buf = open(path, "rb").read()
    w = walk(buf)
    off = w["kvs"]["s.name"]["value_off"] + 8  # "small"
    p = tmp_path / "bad_utf8.gguf"
    p.write_bytes(buf[:off] + b"\xff" + buf[off + 1:])
    assert GgufFile(str(p)).metadata()["s.name"] == "\ufffdmall"


def test_version_2(tmp_path):
    path = write_small(tmp_path / "small.gguf")
    buf = patch(open(path, "rb").read(), 4, "<I", 2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(buf)
    assert GgufFile(str(p)).version == 2


def test_pathlike_and_repr(tmp_path):
    path = write_small(tmp_path / "small.gguf")
    f = GgufFile(tmp_path / "small.gguf")
    assert f.path == path
    assert "3 tensors" in repr(f)


# --------------------------------------------------------------------------------------------
# Corrupt files
# --------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    path = write_small(tmp_path / "small.gguf")
    buf = open(path, "rb").read()
    return buf, walk(buf)


def expect_error(tmp_path, buf: bytes, *words, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(buf)
    with pytest.raises(ValueError) as ei:
        GgufFile(str(p))
    msg = str(ei.value)
    assert msg.startswith(str(p) + ": "), msg
    msg = msg[len(str(p)) + 2:]  # the directory name must not satisfy the checks below
    for word in words:
        assert word.lower() in msg.lower(), (word, msg)
    return msg


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        GgufFile(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="Is a directory"):
        GgufFile(str(tmp_path))


def test_empty_file(tmp_path):
    expect_error(tmp_path, b"", "empty")


@pytest.mark.parametrize(
    "head, words",
    [
        (b"GGML" + bytes(60), ["not a GGUF", "magic"]),
        (b"tjgg" + bytes(60), ["legacy"]),
        (b"FUGG" + bytes(60), ["big-endian"]),
        (struct.pack("<Q", 20) + b'{"a": {"dtype": 1}}' + bytes(40), ["safetensors"]),
        (b"PK\x03\x04" + bytes(60), ["ZIP"]),
        (b"\x00\x01", ["not a GGUF"]),
    ],
)
def test_bad_magic(tmp_path, head, words):
    expect_error(tmp_path, head, *words)


@pytest.mark.parametrize("version", [0, 1, 4, 99, 2**32 - 1])
def test_unsupported_version(tmp_path, small, version):
    buf, w = small
    msg = expect_error(tmp_path, patch(buf, 4, "<I", version), "version", str(version))
    if version == 1:
        assert "not supported" in msg


def test_big_endian_version(tmp_path, small):
    buf, _ = small
    expect_error(tmp_path, patch(buf, 4, ">I", 3), "big-endian")


def test_truncated_every_header_byte(tmp_path, small):
    buf, w = small
    p = tmp_path / "cut.gguf"
    assert w["data_off"] < 1000
    for cut in range(0, w["data_off"]):
        p.write_bytes(buf[:cut])
        with pytest.raises(ValueError) as ei:
            GgufFile(str(p))
        msg = str(ei.value)
        assert msg.startswith(str(p) + ": "), msg
        msg = msg[len(str(p)):]
        assert "truncated" in msg or "empty" in msg, (cut, msg)


def test_truncated_inside_data(tmp_path, small):
    buf, w = small
    p = tmp_path / "cut.gguf"
    last = max(w["tensors"].values(), key=lambda t: t["offset"])
    last_end = w["data_off"] + last["offset"] + 16 * 4  # w2: 16 float32
    assert last_end <= len(buf)
    cuts = list(range(w["data_off"], last_end, 3)) + [last_end - 1]
    for cut in cuts:
        p.write_bytes(buf[:cut])
        with pytest.raises(ValueError) as ei:
            GgufFile(str(p))
        msg = str(ei.value)[len(str(p)):]
        assert "truncated" in msg and "past the end" in msg, (cut, msg)
        assert "w2" in msg or "data section" in msg or "w1" in msg or "w0" in msg, msg


def test_hostile_counts(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensor_count_off"], "<Q", 2**62), "tensor_count")
    expect_error(tmp_path, patch(buf, w["kv_count_off"], "<Q", 2**62), "kv_count")
    expect_error(tmp_path, patch(buf, w["kv_count_off"], "<Q", 2**64 - 1), "kv_count")
    # plausible but one too many: the padding is read as a fourth tensor info
    expect_error(tmp_path, patch(buf, w["tensor_count_off"], "<Q", 4), "tensor info #3")


def test_string_length_past_eof(tmp_path, small):
    buf, w = small
    kv = w["kvs"]["s.name"]
    msg = expect_error(tmp_path, patch(buf, kv["value_off"], "<Q", len(buf)), "truncated",
                       "s.name")
    assert str(kv["value_off"]) in msg
    expect_error(tmp_path, patch(buf, kv["key_off"], "<Q", 2**63), "truncated", "key")
    t = w["tensors"]["w1"]
    expect_error(tmp_path, patch(buf, t["name_off"], "<Q", 2**64 - 1), "truncated", "tensor info #1")


def test_array_length_huge(tmp_path, small):
    buf, w = small
    for key in ("s.arr", "s.strs"):
        kv = w["kvs"][key]
        expect_error(tmp_path, patch(buf, kv["count_off"], "<Q", 2**60), "array", key)


def test_unknown_value_type(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["kvs"]["s.flag"]["type_off"], "<I", 13),
                 "unknown value type 13", "s.flag")
    expect_error(tmp_path, patch(buf, w["kvs"]["s.arr"]["elem_type_off"], "<I", 99),
                 "unknown value type 99", "s.arr")


def test_bool_not_0_or_1(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["kvs"]["s.flag"]["value_off"], "<B", 7), "bool", "7",
                 "s.flag")


def test_unknown_tensor_type(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensors"]["w1"]["type_off"], "<I", 200),
                 "unknown tensor type id 200", "w1")


@pytest.mark.parametrize("nd", [0, 5, 9, 2**32 - 1])
def test_bad_n_dims(tmp_path, small, nd):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensors"]["w0"]["ndims_off"], "<I", nd), "n_dims",
                 "w0")


def test_zero_dim(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensors"]["w2"]["dims_off"][1], "<Q", 0), "zero", "w2")


def test_dim_overflow(tmp_path, small):
    buf, w = small
    t = w["tensors"]["w2"]
    b = patch(patch(buf, t["dims_off"][0], "<Q", 2**40), t["dims_off"][1], "<Q", 2**40)
    expect_error(tmp_path, b, "overflow", "w2")
    # element count fits, byte size does not (F32: 4 bytes each)
    b = patch(patch(buf, t["dims_off"][0], "<Q", 2**31), t["dims_off"][1], "<Q", 2**31)
    expect_error(tmp_path, b, "overflow", "w2")
    expect_error(tmp_path, patch(buf, t["dims_off"][0], "<Q", 2**64 - 1), "w2")


def test_ne0_not_multiple_of_block(tmp_path, small):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensors"]["w1"]["dims_off"][0], "<Q", 33),
                 "block size", "w1")


def test_tensor_data_past_eof(tmp_path, small):
    buf, w = small
    t = w["tensors"]["w0"]
    expect_error(tmp_path, patch(buf, t["offset_off"], "<Q", 1 << 20), "past the end", "w0")
    expect_error(tmp_path, patch(buf, t["offset_off"], "<Q", 2**64 - 32), "past the end", "w0")
    # dims grown so that the data runs past the end
    expect_error(tmp_path, patch(buf, t["dims_off"][0], "<Q", 1 << 16), "past the end", "w0")


def test_misaligned_offset(tmp_path, small):
    buf, w = small
    t = w["tensors"]["w1"]
    expect_error(tmp_path, patch(buf, t["offset_off"], "<Q", t["offset"] + 4), "align", "w1")


@pytest.mark.parametrize("value", [0, 3, 48, 2**31 + 1])
def test_bad_alignment(tmp_path, small, value):
    buf, w = small
    expect_error(tmp_path, patch(buf, w["kvs"]["general.alignment"]["value_off"], "<I", value),
                 "general.alignment", "power of two")


def test_alignment_wrong_type(tmp_path, small):
    buf, w = small
    b = patch(buf, w["kvs"]["general.alignment"]["type_off"], "<I", int(VT.INT32))
    expect_error(tmp_path, b, "general.alignment", "uint32")


def test_duplicate_tensor_names(tmp_path, small):
    buf, w = small
    off = w["tensors"]["w1"]["name_off"] + 8
    b = buf[:off] + b"w0" + buf[off + 2:]
    expect_error(tmp_path, b, "duplicate tensor name", "w0")


def test_duplicate_keys(tmp_path, small):
    buf, w = small
    off = w["kvs"]["k.b"]["key_off"] + 8
    b = buf[:off] + b"k.a" + buf[off + 3:]
    expect_error(tmp_path, b, "duplicate metadata key", "k.a")


def test_invalid_utf8_names(tmp_path, small):
    buf, w = small
    off = w["tensors"]["w1"]["name_off"] + 8
    expect_error(tmp_path, buf[:off] + b"\xc3(" + buf[off + 2:], "tensor name", "UTF-8")
    off = w["kvs"]["k.b"]["key_off"] + 8
    expect_error(tmp_path, buf[:off] + b"\xed\xa0\x80" + buf[off + 3:], "metadata key", "UTF-8")


def test_empty_tensor_name(tmp_path, small):
    # name length 0: the following bytes are re-read as fields, but the empty name is first
    buf, w = small
    expect_error(tmp_path, patch(buf, w["tensors"]["w0"]["name_off"], "<Q", 0), "empty tensor name")


def _raw_gguf(kvs: list[bytes], tensor_infos: list[bytes] = (), version=3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, len(tensor_infos), len(kvs)) + b"".join(
        kvs) + b"".join(tensor_infos)


def _gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def test_too_many_keys(tmp_path):
    # 14 bytes each on disk but ~200 in memory: a hostile header is capped, not amplified
    kvs = [_gstr(b"k%d" % i) + struct.pack("<IB", int(VT.UINT8), 1) for i in range(70000)]
    expect_error(tmp_path, _raw_gguf(kvs), "kv_count 70000", "65536")
    p = tmp_path / "many.gguf"
    p.write_bytes(_raw_gguf(kvs[:65536]))
    md = GgufFile(str(p)).metadata()
    assert len(md) == 65536 and md["k65535"] == 1


def test_deeply_nested_array(tmp_path):
    depth = 200
    val = struct.pack("<IQ", int(VT.INT32), 0)
    for _ in range(depth - 1):
        val = struct.pack("<IQ", int(VT.ARRAY), 1) + val
    kv = _gstr(b"deep") + struct.pack("<I", int(VT.ARRAY)) + val
    expect_error(tmp_path, _raw_gguf([kv]), "nested", "deep")
    # moderately nested arrays are fine
    val = struct.pack("<IQ", int(VT.INT32), 1) + struct.pack("<i", 5)
    for _ in range(3):
        val = struct.pack("<IQ", int(VT.ARRAY), 1) + val
    kv = _gstr(b"ok") + struct.pack("<I", int(VT.ARRAY)) + val
    empty = _gstr(b"empty") + struct.pack("<IIQ", int(VT.ARRAY), int(VT.STRING), 0)
    p = tmp_path / "nest_ok.gguf"
    p.write_bytes(_raw_gguf([kv, empty]))
    md = GgufFile(str(p)).metadata()
    assert md == {"ok": [[[[5]]]], "empty": []}  # GgufArray compares equal to lists
    assert md["ok"].tolist() == [[[[5]]]] and md["ok"][0][0][0].dtype == np.int32


def test_raw_minimal_tensor_file(tmp_path):
    ti = _gstr(b"x") + struct.pack("<I", 1) + struct.pack("<Q", 4) + struct.pack("<IQ", 0, 0)
    hdr = _raw_gguf([], [ti], version=2)
    data_off = (len(hdr) + 31) // 32 * 32
    payload = struct.pack("<4f", 1, 2, 3, 4)
    p = tmp_path / "raw.gguf"
    p.write_bytes(hdr + bytes(data_off - len(hdr)) + payload)
    f = GgufFile(str(p))
    assert f.data_offset == data_off
    assert f.tensor_data("x").view(np.float32).tolist() == [1, 2, 3, 4]


def test_byte_flip_fuzz(tmp_path, small):
    buf, w = small
    rng = random.Random(12345)
    p = tmp_path / "fuzz.gguf"
    region = w["data_off"]
    opened = failed = 0
    specials = [0x00, 0xFF, 0x7F, 0x80, 0x01, 0x20]
    for it in range(300):
        b = bytearray(buf)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(region)
            b[i] = rng.choice(specials) if rng.random() < 0.3 else b[i] ^ (1 << rng.randrange(8))
        p.write_bytes(bytes(b))
        try:
            f = GgufFile(str(p))
        except ValueError as e:
            assert str(e).startswith(str(p) + ": ")
            failed += 1
            continue
        opened += 1
        f.metadata()
        for t in f.tensors():
            arr = f.tensor_data(t["name"])
            assert arr.size == t["nbytes"]
            assert t["offset"] + t["nbytes"] <= len(b)
            int(arr.sum())  # touch every byte: must be inside the mapping
    assert failed > 0


# --------------------------------------------------------------------------------------------
# The real model
# --------------------------------------------------------------------------------------------


def test_real_model(smollm2_path):
    f = assert_same_as_oracle(smollm2_path)
    md = f.metadata()
    assert md["general.architecture"] == "llama"
    assert len(md["tokenizer.ggml.tokens"]) > 40000
    assert md["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert md["tokenizer.ggml.token_type"].dtype == np.int32
    assert f.get_int("llama.block_count") > 0
    ts = f.tensors()
    assert all(t["supported"] for t in ts)
    assert {t["type"] for t in ts} >= {"Q4_1"}
