"""`tensorfold eval`: perplexity, KL divergence and same-top-token rate, checked against the
same measures computed with transformers (torch) on the models the GGUFs were converted from:
a tiny random llama (the reference) and a perturbed copy of it (the "quantized" model)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold.convert import convert  # noqa: E402
from tensorfold.evaluate import evaluate  # noqa: E402

from test_hf_parity import _tokenizer  # noqa: E402

CTX = 48
TEXT = " ".join(f"The quick brown fox number {i} jumps over {i * 7 % 13} lazy dogs; def f(x): return x * {i}."
                for i in range(40))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(reference HF model, its GGUF, perturbed HF model, its GGUF)."""
    out = []
    torch.manual_seed(7)
    base = None
    for name in ("ref", "model"):
        d = tmp_path_factory.mktemp(name)
        vocab = _tokenizer(d)
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                                       tie_word_embeddings=False, initializer_range=0.1)
        m = transformers.LlamaForCausalLM(cfg).eval()
        if base is None:
            base = m.state_dict()
        else:  # the same weights with a little noise: a stand-in for quantization error
            g = torch.Generator().manual_seed(3)
            m.load_state_dict({k: v + 0.02 * torch.randn(v.shape, generator=g) * v.std() for k, v in base.items()})
        m.save_pretrained(d, safe_serialization=True)
        path = str(d / "m.gguf")
        convert(str(d), path, "f32", progress=False)
        out += [m, path]
    return tuple(out)


def _torch_measures(ref, model, ids, bos):
    """The same measures from transformers' logits: chunks of CTX, each begun with BOS (when the
    model adds one), the second half scored."""
    nll, nll_ref, kld, same = [], [], [], []
    first = CTX // 2
    for c in range(len(ids) // CTX):
        chunk = torch.tensor([ids[c * CTX:(c + 1) * CTX]])
        if bos is not None:
            chunk[0, 0] = bos
        with torch.no_grad():
            lp = torch.log_softmax(model(chunk).logits[0].double(), -1)[first:-1]
            lr = torch.log_softmax(ref(chunk).logits[0].double(), -1)[first:-1]
        tgt = chunk[0, first + 1:]
        nll.append(-lp[torch.arange(len(tgt)), tgt])
        nll_ref.append(-lr[torch.arange(len(tgt)), tgt])
        kld.append(torch.nn.functional.kl_div(lp, lr, log_target=True, reduction="none").sum(-1))
        same.append(lp.argmax(-1) == lr.argmax(-1))
    cat = lambda xs: torch.cat(xs).numpy()  # noqa: E731
    return cat(nll), cat(nll_ref), cat(kld), cat(same)


def test_eval_matches_transformers(pair):
    ref_hf, ref_path, model_hf, model_path = pair
    model = tensorfold.Engine(model_path, threads=2, context=CTX, kv_type="f32")
    ref = tensorfold.Engine(ref_path, threads=2, context=CTX, kv_type="f32")
    res = evaluate(model, TEXT, ref=ref, ctx=CTX, progress=False)
    ids = model.tokenize(TEXT, add_special=False)
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    nll, nll_ref, kld, same = _torch_measures(ref_hf, model_hf, ids, bos)
    assert res.chunks == len(ids) // CTX >= 3 and res.scored_tokens == len(nll)
    assert res.ppl == pytest.approx(math.exp(nll.mean()), rel=1e-4)
    assert res.ppl_ref == pytest.approx(math.exp(nll_ref.mean()), rel=1e-4)
    assert res.kld_mean == pytest.approx(kld.mean(), rel=1e-3, abs=1e-7)
    assert res.kld_p99 == pytest.approx(np.percentile(kld, 99), rel=1e-3, abs=1e-7)
    assert res.kld_max == pytest.approx(kld.max(), rel=1e-3, abs=1e-7)
    assert res.same_top == pytest.approx(same.mean(), abs=1.5 / len(same))  # a near-tie may flip one
    assert 0 < res.kld_mean and res.same_top < 1.0  # the perturbation shows


def test_eval_of_a_model_against_itself_is_zero(pair):
    _, ref_path, _, _ = pair
    eng = tensorfold.Engine(ref_path, threads=2, context=CTX)
    res = evaluate(eng, TEXT, ref=eng, ctx=CTX, max_chunks=2, progress=False)
    assert res.chunks == 2 and res.kld_max == 0.0 and res.same_top == 1.0 and res.ppl == res.ppl_ref


def test_eval_cli_table_json_and_errors(pair, tmp_path):
    _, ref_path, _, model_path = pair
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "r.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "tensorfold.cli", "eval", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    p = run(model_path, "--ref", ref_path, "--text", str(text), "--ctx", str(CTX), "--json", str(out), "-q")
    assert p.returncode == 0, p.stderr
    assert "perplexity" in p.stdout and "KLD p99" in p.stdout and "same top token" in p.stdout
    data = json.loads(out.read_text())
    assert data["ctx"] == CTX and data["kld_mean"] > 0 and 0 < data["same_top"] < 1
    # a text shorter than one chunk, a missing file, a reference with another vocabulary
    short = tmp_path / "s.txt"
    short.write_text("too short", encoding="utf-8")
    p = run(model_path, "--text", str(short), "--ctx", str(CTX), "-q")
    assert p.returncode != 0 and "fewer than one chunk" in p.stderr and "Traceback" not in p.stderr
    p = run(model_path, "--text", str(tmp_path / "missing.txt"), "-q")
    assert p.returncode != 0 and "cannot read --text" in p.stderr and "Traceback" not in p.stderr
    p = run(model_path, "--ref", "smollm2-135m-instruct", "--text", str(text), "--ctx", str(CTX), "-q")
    assert p.returncode != 0 and "tokenize the text differently" in p.stderr and "Traceback" not in p.stderr
