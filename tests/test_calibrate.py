"""`tensorfold calibrate` (the importance matrix) against oracles outside the project:

- transformers (CPU torch) on tiny random models converted with `tensorfold convert`: the
  input of every nn.Linear (forward pre-hooks), the router's input, and each routed expert's
  inputs recomputed from the router's top-k choice, over the same token chunks: sums of
  squares within 1e-3 of the largest, token counts exact;
- llama.cpp (when its tools are built; LLAMA_BIN or the vendored llama-cpp-python build):
  `llama-imatrix` on the same GGUF, text and ctx gives the same file (read with our
  load_imatrix), and `llama-quantize --imatrix` accepts ours and uses it;
- the CLI: its errors, and that the file it writes round-trips through load_imatrix.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")

import tensorfold  # noqa: E402
from tensorfold.calibrate import ImatrixError, collect, load_imatrix, write_imatrix  # noqa: E402
from tensorfold.cli import main as cli_main  # noqa: E402
from tensorfold.convert import convert  # noqa: E402
from tensorfold.evaluate import _chunks  # noqa: E402

from test_hf_parity import _tokenizer  # noqa: E402

CTX = 32
CHUNKS = 6
RTOL = 1e-4  # of the largest sum of a tensor (measured: ~4e-7)
TEXT = " ".join(f"The quick brown fox number {i} jumps over {i * 7 % 13} lazy dogs; def f(x): return x * {i}."
                for i in range(40))

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                 dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], head_dim=16)),
    # a shared expert with its sigmoid gate (ffn_gate_inp_shexp, a one-row weight)
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                 dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6,
                      num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])),
}
# transformers module (under model.layers.N) -> GGUF weight
HF_LINEAR = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             # MLA (deepseek2) and shared experts
             "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
             "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
             "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
DEEPSEEK = Path(__file__).parent / "fixtures" / "deepseek2"  # tiny V2-Lite / V3 checkpoints + llama.cpp GGUFs


def _llama_bin() -> Path | None:
    for d in (os.environ.get("LLAMA_BIN"), "/tmp/dl/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"):
        if d and (Path(d) / "llama-imatrix").is_file() and (Path(d) / "llama-quantize").is_file():
            return Path(d)
    return None


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    """(arch, transformers model, its F32 GGUF, the calibration text file)."""
    arch = request.param
    cfg_name, cls_name, extra = ARCHS[arch]
    d = tmp_path_factory.mktemp(arch)
    vocab = _tokenizer(d)
    torch.manual_seed(11)
    cfg = getattr(transformers, cfg_name)(vocab_size=vocab, **{**COMMON, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    path = str(d / "model-f32.gguf")
    convert(str(d), path, "f32", progress=False)
    text = d / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    return arch, model, path, str(text)


@pytest.fixture(scope="module")
def ours(tiny):
    """Our statistics of the tiny model, and the token chunks they were collected on."""
    _, _, path, _ = tiny
    with tensorfold.Engine(path, threads=2, context=CTX, kv_tokens=CTX, kv_type="f32", prefix_cache=False) as eng:
        res = collect(eng, TEXT, ctx=CTX, max_chunks=CHUNKS, progress=False)
        tok = eng.tokenizer
        chunks = _chunks(eng.tokenize(TEXT, add_special=False), CTX, tok.bos_id if tok.add_bos else None, CHUNKS)
    assert res.chunks == CHUNKS and res.tokens == CHUNKS * CTX
    return res, chunks


def _hf_stats(model, chunks, kv_b_split: bool = True) -> dict:
    """{GGUF weight name: (sum2 [n_mat, in_dim], counts [n_mat])} from transformers.
    kv_b_split: MLA's kv_b_proj is attn_k_b/attn_v_b per head (else one attn_kv_b)."""
    cfg = model.config
    acc: dict[str, list] = {}

    def add(name, x, mat=0, n_mat=1):
        x = x.detach().double().reshape(-1, x.shape[-1])
        s = acc.setdefault(name, [np.zeros((n_mat, x.shape[-1])), np.zeros(n_mat, np.int64)])
        s[0][mat] += (x * x).sum(0).numpy()
        s[1][mat] += x.shape[0]

    def experts_hook(il):
        def hook(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            x = x.reshape(-1, x.shape[-1])
            n = mod.gate_up_proj.shape[0]
            for e in range(n):
                rows = (idx == e).any(-1)
                xe = x[rows]
                gate, up = torch.nn.functional.linear(xe, mod.gate_up_proj[e]).chunk(2, dim=-1)
                h = torch.nn.functional.silu(gate) * up
                add(f"blk.{il}.ffn_gate_exps.weight", xe, e, n)
                add(f"blk.{il}.ffn_up_exps.weight", xe, e, n)
                add(f"blk.{il}.ffn_down_exps.weight", h, e, n)
        return hook

    def mla_hooks(il, attn):
        """attn_k_b takes each head's q_nope; attn_v_b each head's attention output in latent
        space: softmax weights (eager attention returns them) times the normed latent, which is
        kv_b_proj's input."""
        H, N = attn.num_heads, attn.qk_nope_head_dim
        latent = {}

        def q_out(m, a, out):
            q = out.reshape(-1, H, out.shape[-1] // H)[..., :N]
            for h in range(H):
                add(f"blk.{il}.attn_k_b.weight", q[:, h], h, H)

        def attn_out(m, a, out):
            w = out[1][0]  # [H, T, T]
            o = w.double() @ latent["c"].reshape(-1, latent["c"].shape[-1]).double()
            for h in range(H):
                add(f"blk.{il}.attn_v_b.weight", o[h], h, H)

        q_mod = attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj
        return [q_mod.register_forward_hook(q_out),
                attn.kv_b_proj.register_forward_pre_hook(lambda m, a: latent.__setitem__("c", a[0])),
                attn.register_forward_hook(attn_out)]

    hooks = []
    for il, layer in enumerate(model.model.layers):
        if hasattr(layer.self_attn, "kv_b_proj"):
            if kv_b_split:
                hooks += mla_hooks(il, layer.self_attn)
            else:
                hooks.append(layer.self_attn.kv_b_proj.register_forward_pre_hook(
                    lambda m, a, name=f"blk.{il}.attn_kv_b.weight": add(name, a[0])))
        for path, short in HF_LINEAR.items():
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                continue
            if mod is not None and (isinstance(mod, torch.nn.Linear) or short == "ffn_gate_inp"):
                hooks.append(mod.register_forward_pre_hook(
                    lambda m, a, name=f"blk.{il}.{short}.weight": add(name, a[0])))
        if hasattr(layer.mlp, "experts"):
            hooks.append(layer.mlp.experts.register_forward_pre_hook(experts_hook(il), with_kwargs=True))
    hooks.append(model.lm_head.register_forward_pre_hook(lambda m, a: add("output.weight", a[0])))
    try:
        with torch.no_grad():
            for c in chunks:
                model(torch.tensor([c]))
    finally:
        for h in hooks:
            h.remove()
    assert cfg.tie_word_embeddings is False
    return {k: (v[0], v[1]) for k, v in acc.items()}


def _compare(ref: dict, got: dict, what: str, rtol: float = RTOL) -> float:
    """Every entry of ref in got: counts exact, sums within RTOL of the largest; returns the
    largest relative difference."""
    worst = 0.0
    for name, (s_ref, c_ref) in ref.items():
        assert name in got, f"{what}: {name} missing from ours"
        s, c = got[name]
        s_ref = np.asarray(s_ref, np.float64).reshape(len(c_ref), -1)
        assert np.asarray(s).shape == s_ref.shape, f"{what}: {name} shape {np.asarray(s).shape} != {s_ref.shape}"
        np.testing.assert_array_equal(np.asarray(c), np.asarray(c_ref), err_msg=f"{what}: {name} counts")
        rel = float(np.abs(np.asarray(s, np.float64) - s_ref).max() / max(s_ref.max(), 1e-30))
        assert rel <= rtol, f"{what}: {name} sums differ by {rel:.3g} of the largest"
        worst = max(worst, rel)
    return worst


def test_matches_transformers(tiny, ours):
    arch, model, _, _ = tiny
    res, chunks = ours
    ref = _hf_stats(model, chunks)
    assert set(res.stats) == set(ref), \
        f"weights: ours only {set(res.stats) - set(ref)}, hf only {set(ref) - set(res.stats)}"
    worst = _compare(ref, res.stats, arch)
    print(f"{arch}: max relative difference vs transformers {worst:.2e} over {len(ref)} weights")
    if arch in ("qwen3moe", "qwen2moe"):
        counts = res.stats["blk.0.ffn_gate_exps.weight"][1]
        assert counts.shape == (6,) and counts.sum() == CHUNKS * CTX * 2  # top-2: every token twice
        assert res.stats["blk.0.ffn_gate_inp.weight"][1].tolist() == [CHUNKS * CTX]


def test_cli_writes_imatrix_that_round_trips(tiny, ours, tmp_path, capsys):
    arch, _, path, text = tiny
    out = tmp_path / "calib.gguf"
    rc = cli_main(["calibrate", path, "--text", text, "-o", str(out), "--ctx", str(CTX), "--chunks", str(CHUNKS),
                   "-t", "2", "-q"])
    assert rc == 0
    assert f"{CHUNKS * CTX} tokens in {CHUNKS} chunks of {CTX}" in capsys.readouterr().out
    back = load_imatrix(out)
    res, _ = ours
    assert set(back) == set(res.stats)
    for name, (s, c) in back.items():
        assert s.dtype == np.float32 and c.dtype == np.int64
        np.testing.assert_array_equal(c, res.stats[name][1])
    # the CLI's engine keeps the KV cache in F16 (ours: F32): the sums agree to its rounding
    assert _compare(res.stats, back, "cli", rtol=1e-2) > 0
    # write_imatrix + load_imatrix: exactly the float32 of what was collected
    again = tmp_path / "again.gguf"
    write_imatrix(str(again), res.stats, chunk_count=res.chunks, chunk_size=CTX, datasets=[text])
    for name, (s, c) in load_imatrix(again).items():
        np.testing.assert_array_equal(s, res.stats[name][0].astype(np.float32))
        np.testing.assert_array_equal(c, res.stats[name][1])
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.type"].contents() == "imatrix"
    assert r.fields["imatrix.chunk_count"].contents() == CHUNKS
    assert r.fields["imatrix.chunk_size"].contents() == CTX
    assert r.fields["imatrix.datasets"].contents() == [text]
    sha = hashlib.sha256(Path(text).read_bytes()).hexdigest()
    assert r.fields["tensorfold.calibrate.text_sha256"].contents() == sha
    assert "general.architecture" not in r.fields
    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert shapes["blk.0.attn_q.weight.in_sum2"] == [64] and shapes["blk.0.attn_q.weight.counts"] == [1]
    if arch == "qwen3moe":  # 3-D weights: ne [in_dim, n_expert] and [1, n_expert], as llama.cpp writes them
        assert shapes["blk.1.ffn_down_exps.weight.in_sum2"] == [32, 6]
        assert shapes["blk.1.ffn_down_exps.weight.counts"] == [1, 6]


def test_cli_errors(tiny, tmp_path, capsys):
    _, _, path, text = tiny
    out = str(tmp_path / "x.gguf")
    assert cli_main(["calibrate", path, "--text", str(tmp_path / "missing.txt"), "-o", out, "-q"]) == 1
    assert "cannot read --text" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox.", encoding="utf-8")
    assert cli_main(["calibrate", path, "--text", str(short), "-o", out, "--ctx", str(CTX), "-q"]) == 1
    err = capsys.readouterr().err
    assert "fewer than one chunk" in err and "--ctx" in err
    assert cli_main(["calibrate", str(tmp_path / "nope.gguf"), "--text", text, "-o", out, "-q"]) == 1
    assert "not found" in capsys.readouterr().err
    assert cli_main(["calibrate", path, "--text", text, "-o", str(tmp_path / "no" / "dir.gguf"), "-q"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not os.path.exists(out)
    with pytest.raises(SystemExit):
        cli_main(["calibrate", path, "--text", text, "-o", out, "--ctx", "0"])


def test_load_imatrix_rejects_what_is_not_one(tiny, tmp_path):
    _, _, path, _ = tiny
    with pytest.raises(FileNotFoundError):
        load_imatrix(tmp_path / "missing.gguf")
    with pytest.raises(ImatrixError, match="not an importance matrix"):
        load_imatrix(path)  # a model
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x01\x00\x00\x00" + os.urandom(64))
    with pytest.raises(ImatrixError, match="not a GGUF file"):
        load_imatrix(junk)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(ImatrixError, match="not a readable GGUF"):
        load_imatrix(trunc)
    # sums without counts
    half = tmp_path / "half.gguf"
    w = gguf.GGUFWriter(str(half), "")
    w.add_type("imatrix")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones(8, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ImatrixError, match="no counts"):
        load_imatrix(half)
    # sums that do not split into the counts' rows
    odd = tmp_path / "odd.gguf"
    write_imatrix(str(odd), {"a.weight": (np.ones((2, 4)), np.array([3, 5]))}, chunk_count=1, chunk_size=4)
    assert load_imatrix(odd)["a.weight"][1].tolist() == [3, 5]
    w = gguf.GGUFWriter(str(odd), "")
    w.add_type("imatrix")
    w.add_tensor("a.weight.in_sum2", np.ones(7, np.float32))
    w.add_tensor("a.weight.counts", np.ones((2, 1), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ImatrixError, match="7 sums for 2 counts"):
        load_imatrix(odd)


def _without_bos(src: str, dst: Path) -> str:
    """A copy of the GGUF whose tokenizer adds no BOS."""
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    if arch == "deepseek2" and "deepseek2.attention.q_lora_rank" not in reader.fields:
        w.add_uint32("deepseek2.attention.q_lora_rank", 0)  # llama.cpp's loader wants it (0: no q-LoRA)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = False if name == "tokenizer.ggml.add_bos_token" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def _llama_imatrix_vs_ours(path: str, tmp_path: Path, what: str, chunks: int) -> None:
    """llama.cpp's llama-imatrix on the GGUF (a copy whose tokenizer adds no BOS: with BOS,
    llama.cpp's chunks start one token earlier than `tensorfold eval`'s, as it replaces the
    first token of [BOS] + text where eval replaces the text's first), the text and ctx, with
    an F32 KV cache and without flash attention (which rounds through F16): its file, read
    with our load_imatrix, against ours tensor by tensor (--process-output: the head too)."""
    bindir = _llama_bin()
    if bindir is None:
        pytest.skip("llama.cpp's llama-imatrix/llama-quantize not built (set LLAMA_BIN to their directory)")
    path = _without_bos(path, tmp_path / "nobos.gguf")
    text = tmp_path / "calib.txt"
    text.write_text(TEXT, encoding="utf-8")
    with tensorfold.Engine(path, threads=2, context=CTX, kv_tokens=CTX, kv_type="f32", prefix_cache=False) as eng:
        assert not eng.tokenizer.add_bos
        res = collect(eng, TEXT, ctx=CTX, max_chunks=chunks, progress=False)
    out = tmp_path / "llama.gguf"
    p = subprocess.run([str(bindir / "llama-imatrix"), "-m", path, "-f", str(text), "-o", str(out), "-c", str(CTX),
                        "-b", str(CTX), "--chunks", str(chunks), "--process-output", "--no-ppl", "-t", "2",
                        "-ctk", "f32", "-ctv", "f32", "-fa", "off"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    # A 3-D weight llama.cpp multiplies per head (MLA's attn_k_b/attn_v_b) is one row of
    # n_head * in_dim sums and one count there; n_mat splits it into ours' row and count per head.
    shapes = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(path).tensors}
    theirs = load_imatrix(out, n_mat={n: sh[2] for n, sh in shapes.items() if len(sh) == 3})
    assert set(theirs) == set(res.stats), \
        f"ours only {set(res.stats) - set(theirs)}, llama.cpp only {set(theirs) - set(res.stats)}"
    worst = _compare(theirs, res.stats, f"{what} vs llama-imatrix")
    print(f"{what}: max relative difference vs llama-imatrix {worst:.2e} over {len(theirs)} weights")


def test_llama_imatrix_agrees(tiny, tmp_path):
    arch, _, path, _ = tiny
    _llama_imatrix_vs_ours(path, tmp_path, arch, CHUNKS)


def test_llama_imatrix_agrees_deepseek2(deepseek, tmp_path):
    name, _, path = deepseek
    _llama_imatrix_vs_ours(path, tmp_path, f"deepseek2 {name}", 3)


def test_llama_quantize_accepts_ours(tiny, tmp_path):
    bindir = _llama_bin()
    if bindir is None:
        pytest.skip("llama.cpp's llama-quantize not built (set LLAMA_BIN to its directory)")
    arch, _, path, text = tiny
    if arch != "llama":
        pytest.skip("one model is enough")
    calib = tmp_path / "calib.gguf"
    assert cli_main(["calibrate", path, "--text", text, "-o", str(calib), "--ctx", str(CTX), "-q"]) == 0
    outs = {}
    for name, extra in (("with", ["--imatrix", str(calib)]), ("without", [])):
        outs[name] = tmp_path / f"q4_0-{name}.gguf"
        p = subprocess.run([str(bindir / "llama-quantize"), *extra, path, str(outs[name]), "Q4_0", "2"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        if extra:
            assert f"loaded {len(load_imatrix(calib))} importance matrix entries" in p.stdout + p.stderr
            missing = [ln for ln in (p.stdout + p.stderr).splitlines() if "did not find weights for" in ln]
            assert all(ln.endswith("token_embd.weight") for ln in missing), missing  # no input: not ours
    # llama.cpp's Q4_0 quantizer weighs by the importance matrix: the results differ.
    a = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(outs["with"])).tensors}
    b = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(outs["without"])).tensors}
    assert any(not np.array_equal(a[n], b[n]) for n in a if n.endswith("attn_q.weight"))


def test_tied_output_is_recorded_as_token_embd(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    vocab = _tokenizer(d)
    torch.manual_seed(5)
    cfg = transformers.Qwen2Config(vocab_size=vocab, **{**COMMON, "tie_word_embeddings": True})
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(d, safe_serialization=True)
    path = str(tmp_path / "m.gguf")
    convert(str(d), path, "f32", progress=False)
    with tensorfold.Engine(path, threads=2, context=CTX, kv_tokens=CTX, kv_type="f32", prefix_cache=False) as eng:
        res = collect(eng, TEXT, ctx=CTX, max_chunks=2, progress=False)
        tok = eng.tokenizer
        chunks = _chunks(eng.tokenize(TEXT, add_special=False), CTX, tok.bos_id if tok.add_bos else None, 2)
        with pytest.raises(ValueError, match="none are being collected"):
            eng._core.activation_stats()  # collect() detached its collector
        assert eng._core.stop_activation_stats() == {}
    assert "output.weight" not in res.stats and "token_embd.weight" in res.stats
    ref = {}
    h = model.lm_head.register_forward_pre_hook(lambda m, a: ref.setdefault("x", []).append(a[0][0].double()))
    with torch.no_grad():
        for c in chunks:
            model(torch.tensor([c]))
    h.remove()
    x = torch.cat(ref["x"])
    _compare({"token_embd.weight": ((x * x).sum(0).numpy()[None], np.array([len(x)]))}, res.stats, "tied")


@pytest.fixture(scope="module", params=["v2lite", "v3"])
def deepseek(request):
    """(name, transformers model (eager attention), llama.cpp's F32 GGUF of it)."""
    name = request.param
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEEPSEEK / name / "hf", dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return name, hf, str(DEEPSEEK / name / "llamacpp-f32.gguf")


def test_deepseek2_matches_transformers(deepseek):
    """MLA: attn_q or attn_q_a/attn_q_b, attn_kv_a_mqa, per head attn_k_b (q_nope) and attn_v_b
    (the attention output in latent space), attn_output; a leading dense layer; routed experts
    and shared experts; read from llama.cpp's own conversion of the checkpoint."""
    name, hf, path = deepseek
    with tensorfold.Engine(path, threads=2, context=CTX, kv_tokens=CTX, kv_type="f32", prefix_cache=False) as eng:
        res = collect(eng, TEXT, ctx=CTX, max_chunks=3, progress=False)
        tok = eng.tokenizer
        chunks = _chunks(eng.tokenize(TEXT, add_special=False), CTX, tok.bos_id if tok.add_bos else None, 3)
    ref = _hf_stats(hf, chunks)
    assert set(res.stats) == set(ref), f"ours only {set(res.stats) - set(ref)}, hf only {set(ref) - set(res.stats)}"
    cfg = hf.config
    assert res.stats["blk.1.attn_k_b.weight"][0].shape == (cfg.num_attention_heads, cfg.qk_nope_head_dim)
    assert res.stats["blk.1.attn_v_b.weight"][0].shape == (cfg.num_attention_heads, cfg.kv_lora_rank)
    worst = _compare(ref, res.stats, name)
    print(f"deepseek2 {name}: max relative difference vs transformers {worst:.2e} over {len(ref)} weights")


def test_tp2_is_refused(tiny):
    """Under TP each rank sees only its slices: collecting is refused, in Python and natively."""
    arch, _, path, _ = tiny
    if arch != "llama":
        pytest.skip("one model is enough")
    from test_tp import Pair  # rank 0 here, rank 1 a `tensorfold worker` on loopback

    pair = Pair(path, context=CTX)
    try:
        with pytest.raises(ValueError, match="TP=2"):
            collect(pair.engine, TEXT, ctx=CTX, max_chunks=1, progress=False)
        with pytest.raises((ValueError, RuntimeError), match="tensor parallelism"):
            pair.engine._core.start_activation_stats()
        assert pair.engine.logits([1, 2, 3]).shape[0] == 3  # the pair still works
    finally:
        pair.close()


def _unsplit_kv_b(src: str, dst: Path) -> str:
    """A copy of a deepseek2 GGUF as older files were: attn_k_b/attn_v_b merged back into one
    attn_kv_b (per head h: N rows latent -> key nope, then V rows latent -> value)."""
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), "deepseek2")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):
            k_b = np.array(t.data)                                               # [H, C, N]
            v_b = np.array(tensors[t.name.replace("attn_k_b", "attn_v_b")].data)  # [H, V, C]
            kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)         # [H, N + V, C]
            w.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kv_b.reshape(-1, k_b.shape[1])))
            continue
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


def test_deepseek2_unsplit_kv_b_matches_transformers(tmp_path):
    """An older deepseek2 file (one attn_kv_b): recorded as its expanded form takes it, the
    normed latent, which is transformers' kv_b_proj input."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEEPSEEK / "v3" / "hf", dtype=torch.float32).eval()
    path = _unsplit_kv_b(str(DEEPSEEK / "v3" / "llamacpp-f32.gguf"), tmp_path / "kv_b.gguf")
    with tensorfold.Engine(path, threads=2, context=CTX, kv_tokens=CTX, kv_type="f32", prefix_cache=False) as eng:
        res = collect(eng, TEXT, ctx=CTX, max_chunks=2, progress=False)
        tok = eng.tokenizer
        chunks = _chunks(eng.tokenize(TEXT, add_special=False), CTX, tok.bos_id if tok.add_bos else None, 2)
    ref = _hf_stats(hf, chunks, kv_b_split=False)
    assert "blk.0.attn_kv_b.weight" in res.stats and "blk.0.attn_k_b.weight" not in res.stats
    assert set(res.stats) == set(ref)
    _compare(ref, res.stats, "deepseek2 attn_kv_b")
