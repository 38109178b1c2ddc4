"""Speculative decoding (engine/speculative.h): drafts from prompt lookup or a draft model,
verified in one batched forward, the rejected ones rolled back in every cache.

Oracles: greedy output without speculation (the bar: identical tokens and log-probabilities,
single and batched, on every architecture's files as llama.cpp made them, TP=1 and TP=2), and
for sampling a float64 numpy model of the sampler's distribution (top-k, top-p, min-p in
llama.cpp's order, then temperature), against which the rejection sampling's emitted tokens
must pass a chi-square test."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

import tensorfold
from tensorfold import _core

from sampling_reference import binned_chi2, reference_distribution

FIX = pathlib.Path(__file__).parent / "fixtures"
DENSE_Q8 = FIX / "quant" / "dense-Q8_0.gguf"     # llama.cpp's converter + quantizer
DENSE_Q2 = FIX / "quant" / "dense-Q2_K.gguf"     # the same model, 2-bit: a draft that is often wrong
MOE = FIX / "quant" / "moe-Q4_K_M.gguf"
DS2 = FIX / "deepseek2" / "v3" / "llamacpp-f32.gguf"
DS4 = FIX / "deepseek4" / "llamacpp.gguf"


def _prompts(n_vocab: int, seed: int, count: int, length: int = 24) -> list[list[int]]:
    """Prompts that repeat themselves (so prompt lookup finds matches), over a few tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        base = rng.integers(3, min(n_vocab, 300), size=6).tolist()
        p = (base * (length // 6 + 1))[:length]
        p[rng.integers(0, length)] = int(rng.integers(3, min(n_vocab, 300)))
        out.append(p)
    return out


def _run(engine, prompts, max_tokens, speculative=None, top_logprobs=-1, temperature=0.0):
    """All prompts at once (batched by the engine), greedy; tokens (and logprobs) per prompt."""
    core = engine._core
    ids = []
    for i, p in enumerate(prompts):
        spec = speculative[i % len(speculative)] if speculative else ""
        kw = {"speculative": spec} if spec else {}
        ids.append(core.add_request(p, max_tokens, temperature, 0, 1.0, 0.0, 1234 + i, [], True, top_logprobs, **kw))
    toks = {i: [] for i in ids}
    lps = {i: [] for i in ids}
    while core.has_unfinished():
        for ev in core.step():
            if ev[1] >= 0:
                toks[ev[0]].append(ev[1])
                if len(ev) > 4 and ev[4] is not None:
                    lps[ev[0]].append(ev[4])
    return [toks[i] for i in ids], [lps[i] for i in ids]


def _engine(path, **kw):
    kw.setdefault("threads", 2)
    kw.setdefault("context", 256)
    return tensorfold.Engine(str(path), **kw)


# deepseek4: window 8, compression 4 and 128 — 24 + 120 tokens cross every kind of boundary, so
# rejected drafts are rolled back out of windows, compressed entries and compressor state.
CASES = [("dense", DENSE_Q8, 40), ("moe", MOE, 40), ("deepseek2", DS2, 40), ("deepseek4", DS4, 120)]


@pytest.mark.parametrize("name,path,n", CASES, ids=[c[0] for c in CASES])
def test_greedy_lookup_equals_plain(name, path, n):
    """Prompt lookup with a fixed draft length (drafts on every step they can, most rejected on
    random weights): every sequence's tokens equal the plain run's, alone and in a batch of 4."""
    if not path.exists():
        pytest.skip(f"{path} missing")
    plain = _engine(path)
    n_vocab = plain.config["n_vocab"]
    prompts = _prompts(n_vocab, 1, 4)
    ref, _ = _run(plain, prompts, n)
    ref_alone, _ = _run(plain, prompts[:1], n)
    assert ref_alone[0] == ref[0]
    plain.close()
    spec = _engine(path, draft="lookup", draft_max=5, draft_adaptive=False)
    got, _ = _run(spec, prompts, n)
    alone, _ = _run(spec, prompts[:1], n)
    st = spec.stats()
    assert got == ref and alone[0] == ref[0]
    assert st["spec_drafted"] > 20, st  # drafting really happened
    assert 0 < st["spec_accepted"] < st["spec_drafted"], st  # some accepted, some rolled back
    assert st["kv_blocks_used"] == 0  # every sequence's blocks returned


def test_draft_model_greedy_and_mixed_sources():
    """Target Q8_0 with its own Q2_K as draft model (llama.cpp's files): identical tokens and
    log-probabilities, the requests of one batch each with their own source."""
    plain = _engine(DENSE_Q8)
    prompts = _prompts(plain.config["n_vocab"], 2, 5)
    ref, ref_lp = _run(plain, prompts, 32, top_logprobs=2)
    plain.close()
    spec = _engine(DENSE_Q8, draft=str(DENSE_Q2), draft_max=4, draft_adaptive=False)
    assert spec._core.memory_plan["draft"] > DENSE_Q2.stat().st_size // 2
    got, lp = _run(spec, prompts, 32, speculative=["", "draft", "lookup", "none", ""], top_logprobs=2)
    assert got == ref
    for a, b in zip(lp, ref_lp):
        assert len(a) == len(b)
        for (x, tx), (y, ty) in zip(a, b):
            assert x == pytest.approx(y, abs=1e-5) and [t for t, _ in tx] == [t for t, _ in ty]
    st = spec.stats()
    assert st["spec_accepted"] > 0 and st["spec_drafted"] > st["spec_accepted"]


def test_smollm2_lookup_quoting(smollm2_path):
    """The real model quoting its prompt through the chat template: same text, and most drafts
    accepted; stop strings still cut at the same place."""
    text = ("TensorFold runs giant mixture-of-experts models on one or two affordable machines. "
            "Its core is C++, with expert routing, low-bit products and a paged KV cache.")
    msgs = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    plain = _engine(smollm2_path)
    a = plain.generate(messages=msgs, max_tokens=48, temperature=0)
    s1 = plain.generate(messages=msgs, max_tokens=48, temperature=0, stop=["affordable"])
    plain.close()
    # Fixed-length drafts: the adaptive length follows measured step times, so the number drafted
    # (and the accepted share) would depend on the machine's load.
    spec = _engine(smollm2_path, draft="lookup", draft_adaptive=False, draft_max=2)
    b = spec.generate(messages=msgs, max_tokens=48, temperature=0)
    s2 = spec.generate(messages=msgs, max_tokens=48, temperature=0, stop=["affordable"])
    st = spec.stats()
    assert b.token_ids == a.token_ids and b.text == a.text
    assert s2.text == s1.text and s2.finish_reason == s1.finish_reason
    assert st["spec_accepted"] >= 0.5 * st["spec_drafted"] > 0, st


@pytest.mark.parametrize("source", ["lookup", "draft"])
def test_tp2_speculation_equals_tp1(smollm2_path, source):
    """TP=2 (rank 1 a `tensorfold worker` process following rank 0's verify plans, rollbacks
    included) with prompt lookup or a draft model (on rank 0: here the model itself, so most
    drafts pass; lookup on random prompts rejects most): the tokens of TP=1 in compatible mode
    without speculation."""
    from test_tp import Pair

    solo = _engine(smollm2_path, tp_compatible=True, threads=1)
    prompts = _prompts(solo.config["n_vocab"], 3, 3)
    ref, _ = _run(solo, prompts, 24)
    solo.close()
    draft = "lookup" if source == "lookup" else smollm2_path
    pair = Pair(smollm2_path, draft=draft, draft_max=4, draft_adaptive=False)
    try:
        got, _ = _run(pair.engine, prompts, 24)
        st = pair.engine.stats()
    finally:
        pair.close()
    assert got == ref
    assert st["spec_drafted"] > 0 and st["spec_accepted"] > 0, st


def test_adaptive_stops_drafting_when_drafts_fail():
    """A draft model that is always wrong would cost a verify token per step for nothing: the
    adaptive length must stop drafting (a probe now and then)."""
    spec = _engine(DENSE_Q8, draft=str(DENSE_Q2), draft_max=6)
    prompts = [list(range(10, 40))]
    _run(spec, prompts, 64)
    st = spec.stats()
    # At most the first tries at the prior rate, then probes of one token every 16 steps.
    assert st["spec_drafted"] <= 4 * 6 + 64 // 16 + 6, st


def test_refusals(smollm2_path, tmp_path):
    with pytest.raises(Exception, match="vocabulary"):
        _engine(DENSE_Q8, draft=smollm2_path)
    with pytest.raises(FileNotFoundError, match="draft '/nonexistent.gguf'"):
        _engine(DENSE_Q8, draft="/nonexistent.gguf")
    import gguf

    other = tmp_path / "gpt2.gguf"  # a file of an architecture the engine does not run
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(Exception, match="^draft model: .*gpt2"):
        _engine(DENSE_Q8, draft=str(other))
    with pytest.raises(ValueError, match="draft_max"):
        _engine(DENSE_Q8, draft="lookup", draft_max=0)
    e = _engine(DENSE_Q8, draft="lookup")
    with pytest.raises(Exception, match="no draft model"):
        e._core.add_request([1, 2, 3], 4, 0.0, 0, 1.0, 0.0, 1, [], False, -1, speculative="draft")
    with pytest.raises(Exception, match="speculative must be"):
        e._core.add_request([1, 2, 3], 4, 0.0, 0, 1.0, 0.0, 1, [], False, -1, speculative="bogus")


# -- rejection sampling ----------------------------------------------------------------------
SAMPLING = [
    (1.0, 0, 1.0, 0.0, 2),    # plain softmax; a likely draft
    (0.7, 0, 1.0, 0.0, 5),    # an unlikely draft
    (1.3, 6, 0.9, 0.05, 0),   # filters on; draft the most likely token
    (1.0, 4, 1.0, 0.0, 9),    # a draft outside the top-k: never accepted
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,draft", SAMPLING)
def test_rejection_sampling_distribution(temperature, top_k, top_p, min_p, draft):
    """Emitted tokens ~ the target's distribution whatever the draft (chi-square, 40k draws, a
    fixed seed), and the draft accepted with its probability."""
    logits = np.array([1.0, 0.2, 2.0, -0.5, 1.5, -1.0, 0.7, 0.0, 1.1, -2.0], np.float32)
    p = reference_distribution(logits, temperature, top_k, top_p, min_p)
    n = 40000
    counts, accepted = _core._sample_given_draft(logits, draft, temperature, top_k, top_p, min_p, 99, n)
    live = p > 0
    assert counts[~live].sum() == 0, "a filtered-out token was emitted"
    exp = p[live] * n
    chi2 = float((((counts[live] - exp) ** 2) / exp).sum())
    dof = int(live.sum()) - 1
    # chi-square critical value at p = 0.001 (Wilson-Hilferty approximation)
    crit = dof * (1 - 2 / (9 * dof) + 3.09 * np.sqrt(2 / (9 * dof))) ** 3 if dof > 0 else 0.0
    assert chi2 <= crit, (chi2, crit, counts, exp)
    assert accepted == pytest.approx(p[draft] * n, abs=4 * np.sqrt(n * p[draft] * (1 - p[draft])) + 1)


def _vocab_logits(n=49152, seed=5):
    """A language model's spread over a SmolLM2-sized vocabulary: a few likely tokens and a long
    tail, with ties and non-finite entries."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    x[rng.choice(n, 8, replace=False)] += 9.0
    x[100:110] = x[99]  # ties
    x[7] = -np.inf
    x[11] = np.nan
    return x


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0),      # no filter: the whole vocabulary in place
    (0.7, 3000, 0.99, 0.0),  # a large top-k, then top-p (both bucketed selections)
])
def test_rejection_sampling_large_vocabulary(temperature, top_k, top_p, min_p):
    """The verification's emitted tokens and acceptance over a 49K vocabulary, with the draft the
    most likely token and then a tail token, against the float64 filter chain."""
    logits = _vocab_logits()
    p = reference_distribution(np.where(np.isfinite(logits), logits, -np.inf), temperature, top_k, top_p, min_p)
    for draft in (int(np.argmax(p)), int(np.flatnonzero(p > 0)[-1])):
        n = 8000
        counts, accepted = _core._sample_given_draft(logits, draft, temperature, top_k, top_p, min_p, 17, n)
        assert counts[p == 0].sum() == 0, "a filtered-out token was emitted"
        chi2, crit = binned_chi2(counts, p)
        assert chi2 <= crit, (chi2, crit)
        assert accepted == pytest.approx(p[draft] * n, abs=4 * np.sqrt(n * p[draft] * (1 - p[draft])) + 1)


def test_greedy_verification_is_argmax():
    logits = np.array([0.1, 3.0, 2.9, -1.0], np.float32)
    counts, accepted = _core._sample_given_draft(logits, 2, 0.0, 0, 1.0, 0.0, 1, 10)
    assert counts[1] == 10 and accepted == 0
    counts, accepted = _core._sample_given_draft(logits, 1, 0.0, 0, 1.0, 0.0, 1, 10)
    assert counts[1] == 10 and accepted == 10


# -- the server ----------------------------------------------------------------------------------
def test_server_with_lookup(smollm2_path):
    """`tensorfold serve --lookup` through the official openai client: the same completions
    (plain, streamed, with a stop string) as an engine without speculation, drafted/accepted
    tokens in `usage` (an extension) and acceptance counters in /metrics."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import urllib.request

    from test_server import Running
    from tensorfold.server import ServerConfig, create_app

    text = "Mixture-of-experts models route every token to a few experts out of many."
    msgs = [{"role": "user", "content": f"Repeat exactly: {text}"}]
    plain = _engine(smollm2_path, context=512)
    ref = plain.generate(messages=msgs, max_tokens=40, temperature=0)
    stop = ref.text.split()[4]  # a word the output has: the stop string cuts there
    ref_stop = plain.generate(messages=msgs, max_tokens=40, temperature=0, stop=[stop])
    assert ref_stop.finish_reason == "stop"
    plain.close()
    eng = _engine(smollm2_path, context=512, draft="lookup")
    srv = Running(create_app(ServerConfig(model_name="m", api_key="k"), engine=eng), eng)
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0)
        assert r.choices[0].message.content == ref.text
        u = r.usage.model_dump()
        assert u["completion_tokens"] == len(ref.token_ids)
        assert u["drafted_tokens"] >= u["accepted_tokens"] > 0, u
        parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="m", messages=msgs, max_tokens=40, temperature=0, stream=True) if ch.choices]
        assert "".join(parts) == ref.text
        r = c.chat.completions.create(model="m", messages=msgs, max_tokens=40, temperature=0, stop=[stop])
        assert r.choices[0].message.content == ref_stop.text and r.choices[0].finish_reason == "stop"
        req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": "Bearer k"})
        metrics = urllib.request.urlopen(req, timeout=30).read().decode()
        drafted = [ln for ln in metrics.splitlines() if ln.startswith("tensorfold_spec_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0, metrics[:2000]
    finally:
        srv.stop()
        eng.close()


# -- the model's own next-token-prediction (MTP) layer -------------------------------------------
@pytest.fixture(scope="module")
def ds3_mtp(tmp_path_factory):
    """The DeepSeek-V3 fixture checkpoint with an MTP layer appended as DeepSeek's release has it
    (model.layers.N: a decoder layer plus eh_proj, enorm, hnorm, shared_head.norm/head and its own
    embed_tokens), converted to GGUF by our converter. Returns (hf_dir, gguf_path)."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    from tensorfold.convert import convert

    src = FIX / "deepseek2" / "v3" / "hf"
    d = tmp_path_factory.mktemp("ds3-mtp")
    import json
    import shutil

    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, d / f.name)
    w = load_file(str(src / "model.safetensors"))
    L, E = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(11)
    for name in [n for n in w if n.startswith(f"model.layers.{L - 1}.")]:
        t = w[name]
        noise = torch.randn(t.shape, generator=g) * (0.02 if t.dim() > 1 else 0.01)
        w[name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = (t + noise.to(t.dtype)).contiguous()
    m = f"model.layers.{L}."
    w[m + "eh_proj.weight"] = torch.randn(E, 2 * E, generator=g) * 0.08
    for k in ("enorm", "hnorm", "shared_head.norm"):
        w[m + k + ".weight"] = 1 + 0.1 * torch.randn(E, generator=g)
    w[m + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    w[m + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    save_file(w, str(d / "model.safetensors"))
    out = d / "ds3-mtp-f32.gguf"
    convert(str(d), str(out), "f32", progress=False)
    return d, out


def test_converter_keeps_mtp_with_llamacpp_names(ds3_mtp):
    """The MTP layer becomes blk.N with llama.cpp's nextn tensor names (gguf's own name table)
    and keys (block_count counts it; nextn_predict_layers)."""
    import gguf

    _, path = ds3_mtp
    r = gguf.GGUFReader(str(path))
    field = lambda k: int(r.fields[k].parts[-1][0])  # noqa: E731
    assert field("deepseek2.block_count") == 4 and field("deepseek2.nextn_predict_layers") == 1
    names = {t.name for t in r.tensors}
    for t in (gguf.MODEL_TENSOR.NEXTN_EH_PROJ, gguf.MODEL_TENSOR.NEXTN_ENORM, gguf.MODEL_TENSOR.NEXTN_HNORM,
              gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM, gguf.MODEL_TENSOR.NEXTN_EMBED_TOKENS,
              gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD):
        assert gguf.TENSOR_NAMES[t].format(bid=3) + ".weight" in names
    assert "blk.3.attn_q_a.weight" in names and "blk.3.ffn_gate_exps.weight" in names


def _rms(x, w, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_logits_match_transformers_layer(ds3_mtp):
    """The MTP draft head against a reference built from transformers' own DeepSeek-V3 decoder
    layer: eh_proj(enorm(embed(t[i+1])) ++ hnorm(final-normed hidden at i)) (llama.cpp's and
    vLLM's input), the layer with the MTP weights (causal, RoPE at i), shared_head norm and head."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdl

    hf, path = ds3_mtp
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    cfg = model.config
    w = load_file(str(hf / "model.safetensors"))
    L, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    ids = _prompts(cfg.vocab_size, 4, 1, 40)[0]
    with torch.no_grad():
        t = torch.tensor([ids])
        h = model.model(input_ids=t).last_hidden_state[0]  # after the final norm
        m = f"model.layers.{L}."
        e = w[m + "embed_tokens.weight"][t[0, 1:]]
        x = torch.cat([_rms(e, w[m + "enorm.weight"], eps), _rms(h[:-1], w[m + "hnorm.weight"], eps)], -1)
        x = x @ w[m + "eh_proj.weight"].T
        # transformers loads the MTP layer's decoder weights itself as one more layer
        deeper = transformers.AutoModelForCausalLM.from_pretrained(
            str(hf), dtype=torch.float32, attn_implementation="eager", num_hidden_layers=L + 1).eval()
        layer = deeper.model.layers[L]
        assert isinstance(layer, mdl.DeepseekV3DecoderLayer)
        torch.testing.assert_close(layer.self_attn.q_a_proj.weight, w[m + "self_attn.q_a_proj.weight"])
        n = x.shape[0]
        pos = torch.arange(n)[None]
        cos_sin = model.model.rotary_emb(x[None], pos)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        y = (y[0] if isinstance(y, tuple) else y)[0]
        ref = (_rms(y, w[m + "shared_head.norm.weight"], eps) @ w[m + "shared_head.head.weight"].T).numpy()
    eng = _engine(path, kv_type="f32")  # the reference keeps float K/V
    got = eng._core.nextn_logits(ids)
    assert got.shape == ref.shape
    span = float(ref.max() - ref.min())
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * span)  # measured: 1e-6 of the span


@pytest.fixture(scope="module")
def ds4_mtp(tmp_path_factory):
    """DeepSeek's release layout of the tiny V4 (FP8 / FP4 experts, with its MTP layer),
    converted by our converter: the MTP layer becomes llama.cpp's nextn layer blk.4."""
    from tensorfold.convert import convert

    out = tmp_path_factory.mktemp("ds4-mtp") / "mtp.gguf"
    convert(str(FIX / "deepseek4" / "official"), str(out), "f32", progress=False)
    return out


MTP_CASES = [("deepseek2", 40), ("deepseek4", 120)]


@pytest.mark.parametrize("name,n", MTP_CASES, ids=[c[0] for c in MTP_CASES])
def test_mtp_greedy_equals_plain(name, n, ds3_mtp, ds4_mtp):
    """Drafting with the file's own nextn layer (deepseek2: the converted V3 fixture above;
    deepseek4: the release layout, whose MTP layer has hyper-connection maps of its own and
    collapses through the main head as llama.cpp runs it): every sequence's tokens equal the
    plain run's, alone and batched."""
    path = ds3_mtp[1] if name == "deepseek2" else ds4_mtp
    plain = _engine(path)
    prompts = _prompts(plain.config["n_vocab"], 5, 3)
    ref, _ = _run(plain, prompts, n)
    plain.close()
    spec = _engine(path, draft="mtp", draft_adaptive=False)
    assert spec._core.memory_plan["draft"] > 0  # the MTP layer's cache and the hidden states it reads
    got, _ = _run(spec, prompts, n)
    alone, _ = _run(spec, prompts[:1], n)
    st = spec.stats()
    assert got == ref and alone[0] == ref[0]
    assert st["spec_drafted"] > n, st  # one draft on (almost) every decode step
    assert st["kv_blocks_used"] == 0


def test_mtp_refused_without_nextn_layers():
    with pytest.raises(Exception, match="no next-token-prediction"):
        _engine(DENSE_Q8, draft="mtp")
