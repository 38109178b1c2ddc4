"""Split GGUF models as llama.cpp's gguf-split writes them (NAME-0000i-of-0000N.gguf, split.no /
split.count / split.tensors.count, model metadata in part 1): any part's path opens the whole
model, it computes exactly as the unsplit file, TP=2 works on it, and broken sets of parts are
refused with a message naming the problem.

The committed fixture (tests/fixtures/split/, made by make_split_fixture.py) was split by
llama.cpp's own llama-gguf-split; the tests that run the tool themselves (on SmolLM2 and with
its other modes) need it: set LLAMA_GGUF_SPLIT or put llama-gguf-split on PATH.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import tensorfold
from tensorfold import _core

gguf = pytest.importorskip("gguf")

FIX = Path(__file__).parent / "fixtures" / "split"
UNSPLIT = FIX / "tiny.gguf"
PARTS = [FIX / f"tiny-{i:05d}-of-00004.gguf" for i in range(1, 5)]
IDS = [5, 17, 3, 250, 9, 33, 101, 7]
GGUF_SPLIT = os.environ.get("LLAMA_GGUF_SPLIT") or shutil.which("llama-gguf-split")
needs_tool = pytest.mark.skipif(not (GGUF_SPLIT and os.access(GGUF_SPLIT, os.X_OK)),
                                reason="llama.cpp's llama-gguf-split not found (set LLAMA_GGUF_SPLIT)")


def _metadata(path) -> dict:
    """Metadata as plain Python values (arrays as lists), for comparing files."""
    out = {}
    for k, v in _core.GgufFile(str(path)).metadata().items():
        out[k] = v.tolist() if hasattr(v, "tolist") else v
    return out


def _split(src: Path, prefix: Path, *opts: str) -> list[Path]:
    subprocess.run([GGUF_SPLIT, *opts, str(src), str(prefix)], check=True, capture_output=True)
    return sorted(prefix.parent.glob(prefix.name + "-*-of-*.gguf"))


def _rewrite(src: Path, dst: Path, keys: dict | None = None, extra: list | None = None) -> None:
    """Copy one GGUF with the gguf package, some metadata values replaced (same types) and
    extra (name, array, type) tensors appended."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields.get("general.architecture")
    w = gguf.GGUFWriter(str(dst), str(arch.contents()) if arch else "qwen2")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, (keys or {}).get(name, field.contents()), vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, data, ty in extra or []:
        w.add_tensor(name, data, raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def parts_copy(tmp_path):
    for p in PARTS:
        shutil.copy(p, tmp_path / p.name)
    return [tmp_path / p.name for p in PARTS]


def test_fixture_is_a_llamacpp_split():
    """What llama.cpp writes, read by the gguf package: 4 parts, u16 split.no / split.count,
    i32 split.tensors.count, the model's metadata only in part 1."""
    total = 0
    for i, p in enumerate(PARTS):
        r = gguf.GGUFReader(str(p))
        assert r.fields["split.no"].types == [gguf.GGUFValueType.UINT16] and r.fields["split.no"].contents() == i
        assert r.fields["split.count"].contents() == 4
        assert r.fields["split.tensors.count"].types == [gguf.GGUFValueType.INT32]
        assert ("general.architecture" in r.fields) == (i == 0)
        total += len(r.tensors)
    assert total == gguf.GGUFReader(str(PARTS[0])).fields["split.tensors.count"].contents() == 26


@pytest.mark.parametrize("which", range(4))
def test_any_part_opens_the_whole_model(which):
    f = _core.GgufFile(str(PARTS[which]))
    assert [Path(p["path"]).name for p in f.parts] == [p.name for p in PARTS]
    assert Path(f.path).name == PARTS[0].name  # the model is named by its first part
    assert f.file_size == sum(p.stat().st_size for p in PARTS)
    # The unsplit file as the gguf package reads it: same tensors, same bytes.
    ref = {t.name: t for t in gguf.GGUFReader(str(UNSPLIT)).tensors}
    ours = f.tensors()
    assert sorted(t["name"] for t in ours) == sorted(ref)
    for t in ours:
        r = ref[t["name"]]
        assert t["type_id"] == int(r.tensor_type) and t["shape"] == [int(d) for d in r.shape]
        assert np.array_equal(f.tensor_data(t["name"]), np.asarray(r.data).view(np.uint8).reshape(-1))
    # Each tensor is said to be in the part that holds it (the gguf package reading each part).
    for i, p in enumerate(PARTS):
        names = {t.name for t in gguf.GGUFReader(str(p)).tensors}
        assert {t["name"] for t in ours if t["part"] == i} == names
        assert f.parts[i]["n_tensors"] == len(names)
    # Metadata: the unsplit file's, plus the split keys of part 1.
    md = _metadata(PARTS[which])
    assert {k: v for k, v in md.items() if not k.startswith("split.")} == _metadata(UNSPLIT)
    assert md["split.no"] == 0 and md["split.count"] == 4


def test_split_computes_as_the_unsplit_file():
    ref = tensorfold.Engine(str(UNSPLIT), threads=2, kv_type="f32", context=128)
    logits = ref.logits(IDS)
    tokens = ref.generate(IDS, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    for p in (PARTS[0], PARTS[2]):
        eng = tensorfold.Engine(str(p), threads=2, kv_type="f32", context=128)
        assert np.array_equal(eng.logits(IDS), logits)
        assert eng.generate(IDS, max_tokens=12, temperature=0, ignore_eos=True).token_ids == tokens


def test_tp2_on_a_split_file():
    """Both ranks open the split model; TP slices are read with pread from the right part."""
    from test_tp import Pair

    solo = tensorfold.Engine(str(UNSPLIT), threads=1, context=128, tp_compatible=True)
    ref = solo.logits(IDS)
    tokens = solo.generate(IDS, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    pair = Pair(str(PARTS[1]), context=128)
    try:
        assert np.array_equal(pair.engine.logits(IDS), ref)
        assert pair.engine.generate(IDS, max_tokens=12, temperature=0, ignore_eos=True).token_ids == tokens
    finally:
        err = pair.close()
    assert pair.worker.returncode == 0, err


def test_missing_part_is_named(parts_copy):
    parts_copy[2].unlink()
    for opened in (parts_copy[0], parts_copy[3]):
        with pytest.raises(ValueError, match=r"tiny-00003-of-00004\.gguf: part 3 of 4 of the split model is missing"):
            _core.GgufFile(str(opened))
    with pytest.raises(ValueError, match="missing"):
        tensorfold.Engine(str(parts_copy[0]), threads=1, context=64)


def test_first_part_missing_is_named(parts_copy):
    parts_copy[0].unlink()
    with pytest.raises(ValueError, match=r"tiny-00001-of-00004\.gguf: part 1 of 4 .* missing"):
        _core.GgufFile(str(parts_copy[1]))


def test_part_of_another_split_is_refused(parts_copy, tmp_path):
    _rewrite(PARTS[1], parts_copy[1], {"split.count": 5})
    with pytest.raises(ValueError, match=r"tiny-00002-of-00004\.gguf: split\.count is 5 but .* says 4: .*another split"):
        _core.GgufFile(str(parts_copy[0]))


def test_wrong_split_no_is_refused(parts_copy):
    _rewrite(PARTS[2], parts_copy[2], {"split.no": 1})
    with pytest.raises(ValueError, match=r"tiny-00003-of-00004\.gguf: split\.no is 1 but the file is named as part 3"):
        _core.GgufFile(str(parts_copy[0]))


def test_duplicate_tensor_across_parts_is_refused(parts_copy):
    # part 4 also carries a tensor of part 1 (and the total is adjusted, so only the
    # duplicate is wrong)
    r1 = gguf.GGUFReader(str(PARTS[0]))
    t = r1.tensors[-1]
    for i, p in enumerate(PARTS):
        extra = [(t.name, np.array(t.data), t.tensor_type)] if i == 3 else None
        _rewrite(p, parts_copy[i], {"split.tensors.count": 27}, extra)
    with pytest.raises(ValueError, match=rf"tensor '{t.name}' is in part 1 .* and again in part 4 .*duplicate"):
        _core.GgufFile(str(parts_copy[1]))


def test_tensor_total_mismatch_is_refused(parts_copy):
    for i, p in enumerate(PARTS):
        _rewrite(p, parts_copy[i], {"split.tensors.count": 30})
    with pytest.raises(ValueError, match=r"split\.tensors\.count says the model has 30 tensors, but its 4 parts hold 26"):
        _core.GgufFile(str(parts_copy[0]))


def test_renamed_part_is_refused(tmp_path):
    dst = tmp_path / "model.gguf"
    shutil.copy(PARTS[0], dst)
    with pytest.raises(ValueError, match=r"part 1 of a model split into 4 files .* does not end in '-00001-of-00004\.gguf'"):
        _core.GgufFile(str(dst))


def test_info_shows_the_parts():
    from tensorfold.info import describe

    text = describe(str(PARTS[3]), show_tensors=True)
    assert "4 files" in text
    for p in PARTS:
        assert str(p) in text
    assert text.count("8 tensors") == 3 and "2 tensors" in text
    assert "part 4" in text


@needs_tool
@pytest.mark.parametrize("opts", [("--split-max-tensors", "5"), ("--split-max-tensors", "10", "--no-tensor-first-split"),
                                  ("--split-max-size", "1M")])
def test_llamacpp_split_modes(tmp_path, opts):
    """The tool's other layouts, including a first part without tensors."""
    parts = _split(UNSPLIT, tmp_path / "t", *opts)
    assert len(parts) >= 2 or opts[0] == "--split-max-size"
    ref = tensorfold.Engine(str(UNSPLIT), threads=1, kv_type="f32", context=64).logits(IDS)
    f = _core.GgufFile(str(parts[-1]))
    if "--no-tensor-first-split" in opts:
        assert f.parts[0]["n_tensors"] == 0
    assert np.array_equal(tensorfold.Engine(str(parts[-1]), threads=1, kv_type="f32", context=64).logits(IDS), ref)


@needs_tool
def test_llamacpp_split_of_smollm2(tmp_path, smollm2_path):
    """A real model split by llama.cpp into 3 parts computes exactly as the original, and
    llama.cpp's --merge of the parts does too."""
    parts = _split(Path(smollm2_path), tmp_path / "smol", "--split-max-tensors", "100")
    assert len(parts) == 3
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 30]
    ref = tensorfold.Engine(smollm2_path, threads=2, context=128).logits(ids)
    eng = tensorfold.Engine(str(parts[1]), threads=2, context=128)
    assert len(eng._gguf.parts) == 3
    assert np.array_equal(eng.logits(ids), ref)
    eng.close()
    merged = tmp_path / "merged.gguf"
    subprocess.run([GGUF_SPLIT, "--merge", str(parts[0]), str(merged)], check=True, capture_output=True)
    assert np.array_equal(tensorfold.Engine(str(merged), threads=2, context=128).logits(ids), ref)
