"""GGUF files made by llama.cpp's own quantizer — what people download — load in TensorFold and
compute what their weights say.

The fixtures (tests/fixtures/quant/, written by tests/fixtures/make_quant_fixtures.py, which CI
never runs) are tiny random models quantized by llama.cpp's llama-quantize with an importance
matrix to every standard file type: a dense llama (23 file types, Q2_K … TQ2_0), a qwen2moe with
a shared expert (Q2_K, Q4_K_M, IQ1_M, IQ2_XXS, IQ3_XXS, IQ4_XS, MXFP4_MOE), a deeper llama of
256-multiple widths (4 layers; Q3_K_S/M/L, IQ2_XS/S/M, IQ3_XXS, IQ4_XS: the mixes whose attn_v,
attn_output, ffn_down or token_embd get Q4_K/Q5_K/IQ3_S), plus the dense Q4_K_M split into three
parts by llama-gguf-split. Each file carries llama.cpp's own
type mix (attn_v with more bits than attn_q, ffn_down above gate/up, expert types changing
between layers, token_embd/output in Q2_K/Q5_K/Q6_K/Q8_0, …).

The oracle is tests/reference_forward.py: a float64 numpy forward pass over the same weights as
dequantized by the `gguf` package (which DESIGN.md §5 takes as the bit-exact definition of every
format). Nothing of TensorFold is in it. Its own correctness is checked here against transformers
(test_reference_forward_matches_transformers) and, when the fixtures were made, against llama.cpp
on the F16 file (quant_oracle.json "oracle_validation").

Bounds, per file (`e` = the file's entry in quant_oracle.json):
* mean KL(reference || TensorFold) <= max(2 x llama.cpp's mean KL on the same file and tokens,
  KLD_FLOOR). Against the same dequantized weights the only error left is the engine's
  arithmetic: activations rounded to 8 bits per 32 or 256 values before every quantized dot
  product (what llama.cpp and TensorFold both do), float32 accumulation and an F16 KV cache.
  llama.cpp's KL on the file measures exactly that error for a mature engine; TensorFold may
  round differently (other block layouts, other summation order) but not be more than twice as
  far off. The floor covers files where llama.cpp's KL is tiny: an 8-bit per-block rounding has
  a relative error of about 1/(2*sqrt(3)*127) ~ 0.23% of the block maximum per value, i.e. ~0.5%
  of a typical value; through a layer of dot products that is a logit error of ~0.5% of the
  logit scale (std ~3 here) ~ 0.015, and KL ~ 0.5 Var(logit error) ~ 1e-4 — KLD_FLOOR.
* top-1 agreement with the reference >= llama.cpp's (both counted with the same rule). Near
  ties: at a position where the reference's best and the engine's pick are within `e["tie"]`
  logits of each other (2 x the largest |logit error| llama.cpp makes on this file, at least
  1e-3), the pick counts as agreeing — at that distance the reference cannot tell two tokens
  apart at either engine's precision (reference_forward.top1_agreement).
* decode (one token at a time, the GEMV kernels) follows the reference greedily: every token
  TensorFold generates is the reference's top-1 for that prefix, under the same near-tie rule.
* the split file gives bit-identical logits to the unsplit one (same bytes, same kernels), and
  `tensorfold info` lists every tensor with the type recorded in the file.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold.info import describe  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_forward as rf  # noqa: E402

QUANT = Path(__file__).resolve().parent / "fixtures" / "quant"
ORACLE = json.loads((QUANT / "quant_oracle.json").read_text())
FILES = ORACLE["files"]
KLD_FLOOR = 1e-4
N_CTX = 64
N_DECODE = 8


def _id(e: dict) -> str:
    return f"{e['model']}-{e['ftype']}"


@lru_cache(maxsize=None)
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@lru_cache(maxsize=4)
def _reference(path: str) -> rf.ReferenceModel:
    return rf.ReferenceModel(path)


def _sequences(e: dict) -> list[list[int]]:
    return e["sequences"]


def _router_tie(e: dict) -> float:
    return ORACLE["models"][e["model"]]["router_tie"]


@lru_cache(maxsize=4)
def _reference_run(path: str):
    """Reference logits and routing for every sequence of the file, and the mask of positions
    with a router near tie (left out of the comparisons)."""
    e = next(e for e in FILES if str(QUANT / e["file"]) == path)
    model = e["model"]
    ref = _reference(path)
    logits, routings, masks = [], [], []
    for s in e["sequences"]:
        lg, routing = ref.forward(s, return_routing=True)
        logits.append(lg)
        routings.append(routing)
        masks.append(rf.router_near_ties(routing, len(s), ORACLE["models"][model]["router_tie"]))
    return logits, routings, np.concatenate(masks)


def _engine(path: str) -> tensorfold.Engine:
    return tensorfold.Engine(path, threads=2, context=N_CTX)


def _path(e: dict) -> str:
    p = str(QUANT / e["file"])
    assert _sha256(p) == e["sha256"], f"{p} is not the file quant_oracle.json was made from; regenerate"
    return p


@pytest.mark.parametrize("e", FILES, ids=_id)
def test_logits_match_reference(e):
    path = _path(e)
    ref_logits, _, skip = _reference_run(path)
    with _engine(path) as eng:
        ours = [np.asarray(eng.logits(s), dtype=np.float64) for s in _sequences(e)]
    o = np.concatenate(ours)
    assert o.shape == (len(skip), ref_logits[0].shape[1])
    assert np.isfinite(o).all()
    keep = ~skip
    r, o = np.concatenate(ref_logits)[keep], o[keep]
    lc = e["llama_cpp"]
    assert lc["n_positions"] == len(r), "router near ties differ from the oracle's; regenerate"

    kld = float(rf.kld(r, o).mean())
    bound = max(2.0 * lc["mean_kld"], KLD_FLOOR)
    ours_agree = float(rf.top1_agreement(r, o.argmax(-1), e["tie"]).mean())
    lc_top1 = np.concatenate([np.array(t) for t in lc["top1"]])[keep]
    lc_agree = float(rf.top1_agreement(r, lc_top1, e["tie"]).mean())
    msg = (f"{_id(e)}: KL(ref||tensorfold) {kld:.3g} (bound {bound:.3g}; llama.cpp {lc['mean_kld']:.3g}), "
           f"top-1 agreement {ours_agree:.3f} (llama.cpp {lc_agree:.3f}; exact: ours "
           f"{(r.argmax(-1) == o.argmax(-1)).mean():.3f}, llama.cpp {lc['top1_exact']:.3f}), max |logit err| "
           f"{np.abs(r - o).max():.4f} (llama.cpp {lc['max_abs_logit_err']:.4f}), {len(r)} positions")
    assert kld <= bound, msg
    assert ours_agree >= lc_agree, msg


MOE_FILES = [e for e in FILES if ORACLE["models"][e["model"]]["arch"].endswith("moe")]


@pytest.mark.parametrize("e", MOE_FILES, ids=_id)
def test_routing_matches_reference(e):
    """Every router decision that is not a near tie picks the reference's experts."""
    path = _path(e)
    _, routings, _ = _reference_run(path)
    tol = _router_tie(e)
    with _engine(path) as eng:
        for s, ref_routing in zip(_sequences(e), routings):
            ours = eng.routing(s)
            for layer, (mine, theirs) in enumerate(zip(ours, ref_routing)):
                k = len(theirs["experts"][0])
                mine = np.array(mine).reshape(len(s), k)
                for t in range(len(s)):
                    if theirs["gap"][t] >= tol:
                        assert set(mine[t].tolist()) == set(theirs["experts"][t]), (
                            f"{_id(e)}: layer {layer} token {t}: experts {sorted(mine[t].tolist())}, "
                            f"reference {sorted(theirs['experts'][t])} (router gap {theirs['gap'][t]:.3f})")


@pytest.mark.parametrize("e", FILES, ids=_id)
def test_greedy_decode_follows_reference(e):
    path = _path(e)
    ref = _reference(path)
    prompt = min(_sequences(e), key=len)
    with _engine(path) as eng:
        out = eng.generate(prompt, max_tokens=N_DECODE, temperature=0, ignore_eos=True).token_ids
    assert len(out) == N_DECODE
    # the reference on TensorFold's own path: each generated token must be the reference's
    # top-1 (or within the near-tie distance of it) given everything before it; steps whose
    # position has a router near tie are not judged
    path_ids = list(prompt) + list(out[:-1])
    full, routing = ref.forward(path_ids, return_routing=True)
    first = len(prompt) - 1
    skip = rf.router_near_ties(routing, len(path_ids), _router_tie(e))[first:]
    ok = rf.top1_agreement(full[first:], np.array(out), e["tie"]) | skip
    assert ok.all(), (f"{_id(e)}: decode step(s) {np.nonzero(~ok)[0].tolist()} picked tokens the reference "
                      f"ranks below its top-1 by more than {e['tie']:.3g}")


@pytest.mark.parametrize("e", FILES, ids=_id)
def test_info_lists_tensor_types(e):
    path = _path(e)
    listed = {}
    for line in describe(path, show_tensors=True).splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in e["tensor_types"]:
            listed[parts[0]] = parts[1]
    assert listed == e["tensor_types"]


# ------------------------------------------------------------------------------------ split

SPLIT = ORACLE["split"]
SPLIT_PARTS = [str(QUANT / p) for p in SPLIT["parts"]]
SPLIT_SOURCE = next(e for e in FILES if e["file"] == SPLIT["source"])


def _split_ok():
    for p, h in zip(SPLIT_PARTS, SPLIT["part_sha256"]):
        assert _sha256(p) == h, f"{p} is not the part quant_oracle.json recorded; regenerate"


@pytest.mark.parametrize("part", range(len(SPLIT_PARTS)), ids=lambda i: f"open-part-{i + 1}")
def test_split_gives_same_logits(part):
    _split_ok()
    seqs = _sequences(SPLIT_SOURCE)
    with _engine(_path(SPLIT_SOURCE)) as eng:
        whole = [np.array(eng.logits(s)) for s in seqs]
    with _engine(SPLIT_PARTS[part]) as eng:
        split = [np.array(eng.logits(s)) for s in seqs]
    for a, b in zip(whole, split):
        np.testing.assert_array_equal(a, b)


def test_split_info_lists_all_tensors():
    _split_ok()
    listed = {}
    for line in describe(SPLIT_PARTS[0], show_tensors=True).splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in SPLIT_SOURCE["tensor_types"]:
            listed[parts[0]] = parts[1]
    assert listed == SPLIT_SOURCE["tensor_types"]
    # the command line says the same, without error
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(tensorfold.__file__).parents[1]),
                                                      env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-m", "tensorfold.cli", "info", "--tensors", SPLIT_PARTS[0]],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in SPLIT_SOURCE["tensor_types"])


def test_split_missing_part_is_refused(tmp_path):
    _split_ok()
    for p in SPLIT_PARTS[:-1]:
        shutil.copy(p, tmp_path)
    missing = os.path.basename(SPLIT_PARTS[-1])
    with pytest.raises((ValueError, RuntimeError, OSError)) as ei:
        _engine(str(tmp_path / os.path.basename(SPLIT_PARTS[0])))
    text = str(ei.value)
    assert missing in text or "split" in text.lower(), text


# ------------------------------------------------------------------------------------ the oracle itself

@pytest.mark.parametrize("arch", ["llama", "qwen2moe", "qwen3moe"])
def test_reference_forward_matches_transformers(arch, tmp_path):
    """The oracle reproduces transformers on an unquantized (F32) GGUF of each architecture it
    serves here, to ~1e-6 relative (transformers computes its rotary angles in float32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tensorfold.convert import convert

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([(QUANT / "calibration.txt").read_text()], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, initializer_range=0.2)
    if arch == "llama":
        cls, cfg = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            **common, intermediate_size=96, tie_word_embeddings=True)
    elif arch == "qwen2moe":
        cls, cfg = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False)
    else:
        cls, cfg = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=5,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False)
    torch.manual_seed(7)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "gate.weight" in name:
                p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path, safe_serialization=True)
    gguf_path = str(tmp_path / "model-f32.gguf")
    convert(str(tmp_path), gguf_path, "f32", progress=False)
    ref = rf.ReferenceModel(gguf_path)
    model = model.double()
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    for ids in ([5], [17, 3, 250, 9, 33, 101, 7], list(range(40, 63))):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].numpy()
        got = ref.logits(ids)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
