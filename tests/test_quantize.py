"""`tensorfold quantize`: dynamic bit allocation to a bits-per-weight target, the recipe in the
output's metadata, and outputs that llama.cpp and TensorFold both load.

Oracles: the `gguf` package reads the output (tensor types and bytes), llama.cpp (via
llama-cpp-python, when installed) runs it and is compared with TensorFold's logits, and the
quality comparisons use `tensorfold eval` (itself checked against transformers in
test_eval.py)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold import _core  # noqa: E402
from tensorfold.convert import convert  # noqa: E402
from tensorfold.evaluate import evaluate  # noqa: E402
from tensorfold.quantize import QuantizeError, quantize  # noqa: E402

from test_hf_parity import _tokenizer  # noqa: E402

CTX = 64
CALIB = " ".join(f"def handler_{i}(request): return {{'status': {200 + i % 7}, 'items': list(range({i}))}}"
                 for i in range(60))
EVAL = " ".join(f"The {i}th quick brown fox jumps over {i * 7 % 13} lazy dogs while the cat sleeps."
                for i in range(60))
FIXED_RECIPE = ["attn_q=Q4_K", "attn_k=Q4_K", "attn_v=Q6_K", "attn_output=Q4_K", "ffn_gate=Q4_K", "ffn_up=Q4_K",
                "ffn_down=Q6_K", "token_embd=Q4_K", "output=Q6_K"]  # llama.cpp's Q4_K_M roles


def _writable(t: str) -> bool:
    return any(q["name"] == t for q in _core.quant_types()) and _core.can_quantize(
        next(q["id"] for q in _core.quant_types() if q["name"] == t))


needs_kquants = pytest.mark.skipif(not all(_writable(t) for t in ("Q4_K", "Q6_K")),
                                   reason="the K-quant quantizers are not built")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny llama whose layers differ the way real ones do: a few input channels with large
    activations (scaled norm weights) and layers of different weight scales."""
    d = tmp_path_factory.mktemp("hf")
    vocab = _tokenizer(d)
    torch.manual_seed(11)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512, max_position_embeddings=256,
                                   tie_word_embeddings=False, initializer_range=0.05)
    m = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            hot = torch.randperm(256, generator=g)[:6]
            layer.input_layernorm.weight[hot] *= 6.0
            layer.post_attention_layernorm.weight[torch.randperm(256, generator=g)[:6]] *= 6.0
            for lin in (layer.mlp.down_proj, layer.self_attn.o_proj):
                lin.weight.mul_(0.5 + i * 0.5)
    m.save_pretrained(d, safe_serialization=True)
    path = str(d / "f16.gguf")
    convert(str(d), path, "f16", progress=False)
    return d, path


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "calib.txt").write_text(CALIB)
    (d / "eval.txt").write_text(EVAL)
    return str(d / "calib.txt"), str(d / "eval.txt")


@pytest.fixture(scope="module")
def calib(model, texts, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("calib") / "calib.gguf")
    r = subprocess.run([sys.executable, "-m", "tensorfold", "calibrate", model[1], "--text", texts[0], "-o", out,
                        "--ctx", str(CTX), "-t", "2", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def _file_bpw(path: str) -> float:
    r = gguf.GGUFReader(path)
    n = sum(int(t.n_elements) for t in r.tensors)
    b = sum(int(t.n_bytes) for t in r.tensors)
    return 8 * b / n


def _kld(path: str, ref: str, text: str) -> float:
    with tensorfold.Engine(path, threads=2, context=CTX) as m, tensorfold.Engine(ref, threads=2, context=CTX) as r:
        return evaluate(m, open(text).read(), ref=r, ctx=CTX, progress=False).kld_mean


@needs_kquants
@pytest.mark.parametrize("target", [3.0, 4.5, 6.0])
def test_allocation_meets_the_target(tmp_path, model, calib, target):
    out = str(tmp_path / "q.gguf")
    res = quantize(model[1], out, target_bpw=target, calib=calib, threads=2, progress=False, echo=lambda *a, **k: None)
    got = _file_bpw(out)  # counted by the gguf package over every tensor of the file
    assert abs(got - res.bpw) < 1e-9
    assert abs(got - target) <= 0.02, (got, target)


@needs_kquants
def test_beats_a_fixed_per_role_recipe_at_equal_size(tmp_path, model, calib, texts):
    fixed = str(tmp_path / "fixed.gguf")
    quantize(model[1], fixed, target_bpw=None, keep=FIXED_RECIPE, calib=calib, threads=2, progress=False,
             echo=lambda *a, **k: None)
    bpw = _file_bpw(fixed)
    ours = str(tmp_path / "ours.gguf")
    # the sensitivity probes run on the calibration text; the KLD is measured on the evaluation text
    quantize(model[1], ours, target_bpw=bpw, calib=calib, threads=2, progress=False, probe_text=texts[0],
             eval_ctx=CTX, probe_chunks=8, echo=lambda *a, **k: None)
    assert _file_bpw(ours) <= bpw + 1e-9
    assert sorted(os.listdir(tmp_path)) == ["fixed.gguf", "ours.gguf"]  # no probe files left behind
    recipe = json.loads(_core.GgufFile(ours).metadata()["tensorfold.quantize.recipe"])
    roles = {re.sub(r"^blk\.\d+\.|\.weight$", "", t.name) for t in gguf.GGUFReader(ours).tensors
             if len(t.shape) == 2}
    assert set(recipe["sensitivity"]) == roles and all(a > 0 for a in recipe["sensitivity"].values())
    with open(texts[0], "rb") as f:
        assert recipe["probe"]["text_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert recipe["estimated_kld"] > 0
    info = subprocess.run([sys.executable, "-m", "tensorfold", "info", ours], capture_output=True, text=True)
    assert info.returncode == 0 and "KLD/error:" in info.stdout and recipe["probe"]["text_sha256"][:16] in info.stdout
    k_fixed = _kld(fixed, model[1], texts[1])
    k_ours = _kld(ours, model[1], texts[1])
    assert k_ours < k_fixed, (k_ours, k_fixed)


@needs_kquants
def test_output_loads_in_llama_cpp_and_tensorfold(tmp_path, model, calib):
    out = str(tmp_path / "q.gguf")
    quantize(model[1], out, target_bpw=4.0, calib=calib, threads=2, progress=False, echo=lambda *a, **k: None)
    ids = [1, 40, 77, 123, 9, 250, 31, 64, 2, 100]
    with tensorfold.Engine(out, threads=2, context=CTX) as e:
        ours = np.array(e.logits(ids))
        assert e.generate(ids, max_tokens=4, temperature=0).text is not None
    assert np.all(np.isfinite(ours))
    llama_cpp = pytest.importorskip("llama_cpp")
    ll = llama_cpp.Llama(model_path=out, n_ctx=CTX, logits_all=True, verbose=False, n_threads=2)
    try:
        ll.eval(ids)
        theirs = np.array(ll.scores[:len(ids)])
    finally:
        ll.close()
    # Same weights, both quantize activations to 8 bits their own way: close, not bit-equal.
    span = float(theirs.max() - theirs.min())
    assert np.max(np.abs(ours[-1] - theirs[-1])) <= 0.03 * span
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_recipe_hashes_and_eval_are_recorded(tmp_path, model, texts):
    out = str(tmp_path / "q.gguf")
    res = quantize(model[1], out, target_bpw=9.0, threads=2, eval_text=texts[1], eval_ctx=CTX, eval_chunks=4,
                   progress=False, echo=lambda *a, **k: None)
    md = _core.GgufFile(out).metadata()
    with open(model[1], "rb") as f:
        assert md["tensorfold.quantize.source_sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert md["tensorfold.quantize.version"] == tensorfold.__version__
    recipe = json.loads(md["tensorfold.quantize.recipe"])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert recipe["tensors"] == types
    ev = json.loads(md["tensorfold.quantize.eval"])
    assert ev["kld_mean"] == pytest.approx(res.eval["kld_mean"])
    with open(texts[1], "rb") as f:
        assert ev["text_sha256"] == hashlib.sha256(f.read()).hexdigest()
    info = subprocess.run([sys.executable, "-m", "tensorfold", "info", out], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "quantized by:  tensorfold" in info.stdout and "KLD mean" in info.stdout
    assert md["tensorfold.quantize.source_sha256"] in info.stdout


def test_calibration_hashes_are_recorded(tmp_path, model, calib, texts):
    out = str(tmp_path / "q.gguf")
    quantize(model[1], out, target_bpw=9.0, calib=calib, threads=2, progress=False, echo=lambda *a, **k: None)
    md = _core.GgufFile(out).metadata()
    with open(calib, "rb") as f:
        assert md["tensorfold.quantize.calib_sha256"] == hashlib.sha256(f.read()).hexdigest()
    with open(texts[0], "rb") as f:
        assert md["tensorfold.quantize.calib_text_sha256"] == hashlib.sha256(f.read()).hexdigest()


def test_hf_directory_input(tmp_path, model):
    out = str(tmp_path / "q.gguf")
    quantize(str(model[0]), out, target_bpw=8.5, threads=2, progress=False, echo=lambda *a, **k: None)
    assert _file_bpw(out) <= 8.5
    with tensorfold.Engine(out, threads=2, context=CTX) as e:
        assert np.all(np.isfinite(e.logits([1, 2, 3])))


def test_norms_stay_f32_and_keep_rules_apply(tmp_path, model):
    out = str(tmp_path / "q.gguf")
    quantize(model[1], out, target_bpw=None, keep=["*=Q8_0", "blk.0.attn_v.weight=F16"], threads=2,
             progress=False, echo=lambda *a, **k: None)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types["blk.0.attn_v.weight"] == "Q8_0"  # first matching rule wins
    assert all(v == "F32" for k, v in types.items() if "norm" in k)
    assert all(v == "Q8_0" for k, v in types.items() if "norm" not in k)


def test_bad_requests_say_what_to_do(tmp_path, model):
    out = str(tmp_path / "q.gguf")
    quiet = dict(threads=2, progress=False, echo=lambda *a, **k: None)
    with pytest.raises(QuantizeError, match="below what the candidate types allow"):
        quantize(model[1], out, target_bpw=0.5, **quiet)
    with pytest.raises(QuantizeError, match="PATTERN=TYPE"):
        quantize(model[1], out, target_bpw=4.0, keep=["attn_v"], **quiet)
    with pytest.raises(QuantizeError, match="not a type TensorFold writes"):
        quantize(model[1], out, target_bpw=4.0, keep=["attn_v=Q9_9"], **quiet)
    with pytest.raises(QuantizeError, match="no such file"):
        quantize(str(tmp_path / "missing.gguf"), out, target_bpw=4.0, **quiet)
    with pytest.raises(QuantizeError, match="cannot read --probe-text .*missing.txt: No such file"):
        quantize(model[1], out, target_bpw=4.0, probe_text=str(tmp_path / "missing.txt"), **quiet)
    with pytest.raises(QuantizeError, match="cannot read --eval .*missing.txt: No such file"):
        quantize(model[1], out, target_bpw=4.0, eval_text=str(tmp_path / "missing.txt"), **quiet)
    with pytest.raises(QuantizeError, match="overwrite the input"):
        quantize(model[1], model[1], target_bpw=4.0, **quiet)
    r = subprocess.run([sys.executable, "-m", "tensorfold", "quantize", model[1], "-o", out, "--target-bpw", "0.5"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "below what" in r.stderr
    assert not (tmp_path / "q.gguf").exists() and not (tmp_path / "q.gguf.part").exists()


def test_quantize_rows_refuses_bad_input():
    x = np.ones((2, 64), np.float32)
    x[1, 5] = np.nan
    with pytest.raises(ValueError, match="row 1 holds a non-finite"):
        _core.quantize_rows(8, x, None, 1)  # Q8_0
    with pytest.raises(ValueError, match="importance must be"):
        _core.quantize_rows(8, np.ones((2, 64), np.float32), np.ones(3, np.float32), 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        _core.quantize_rows(8, np.ones((2, 64), np.float32), -np.ones(64, np.float32), 1)
    with pytest.raises(ValueError, match="block size"):
        _core.quantize_rows(8, np.ones((2, 48), np.float32), None, 1)
