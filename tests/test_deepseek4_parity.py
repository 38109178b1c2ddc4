"""deepseek4 (DeepSeek-V4: hyper-connections, shared-KV attention over a sliding window plus
compressed entries — all of them, or those a lightning indexer picks —, hash and sqrtsoftplus
routing, clamped SwiGLU) against Hugging Face transformers on tiny random models.

Models (tests/deepseek4_fixture.py, converted here by `tensorfold convert`):
* "flash": DeepSeek's own ratios (CSA 4, HCA 128), YaRN on the compressed branches, window 8,
  the four layers covering window-only / CSA / HCA / CSA and hash / learned routing; its long
  prompt (300 tokens) closes two HCA windows and 74 CSA windows.
* "small-hca": the same with HCA every 8 tokens and odd sizes (hidden 80, 5 heads of 48 in 5
  output groups, top-2 of the indexer's picks, window 6), so short prompts reach every branch
  many times over. (The indexer keeps 8 heads: with few, many entries score exactly 0 after the
  ReLU and the top-k cut falls inside a tie that two implementations break differently.)
Checked: logits (F32 cache: 1e-3 of the logit range; F16: 1e-2), greedy continuations (a
divergence only at a near-tie of the reference), the experts of every layer, chunked prefill and
several sequences batched against one full forward, and the cache bytes per token.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers without DeepseekV4ForCausalLM (needs >= 5.24)", allow_module_level=True)

import tensorfold  # noqa: E402
from tensorfold import native  # noqa: E402
from tensorfold.convert import convert  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import deepseek4_fixture as v4  # noqa: E402

SMALL_HCA = dict(hidden_size=80, num_attention_heads=5, head_dim=48, partial_rotary_factor=1 / 3, q_lora_rank=56,
                 o_groups=5, o_lora_rank=24, index_n_heads=8, index_head_dim=64, index_topk=2,
                 compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                 layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                              "heavily_compressed_attention", "compressed_sparse_attention"],
                 mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"], num_hidden_layers=5,
                 n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=40, sliding_window=6,
                 rope_parameters=None)
MODELS = {"flash": ({}, 300), "small-hca": (SMALL_HCA, 90)}
NEAR_TIE = 1e-3


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    """(name, transformers model, our F32 GGUF, long prompt)."""
    name = request.param
    overrides, n = MODELS[request.param]
    d = tmp_path_factory.mktemp(name)
    hf = v4.make_tiny_deepseek4(d / "hf", **overrides)
    path = d / "model-f32.gguf"
    convert(str(d / "hf"), str(path), "f32", progress=False)
    return name, hf, str(path), v4.prompt_ids(n)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def _engine(path, kv_type="f32", **kw):
    return tensorfold.Engine(path, threads=2, kv_type=kv_type, context=512, **kw)


def _assert_close(name, ours, ref, tol):
    assert ours.shape == ref.shape
    span = float(ref.max() - ref.min())
    per_pos = np.abs(ours - ref).max(-1) / span
    bad = np.nonzero(per_pos > tol)[0]
    assert not len(bad), f"{name}: max |diff| {per_pos.max():.3g} of the logit range (bound {tol}) at {bad[:10]}"


def test_logits_match_transformers(model):
    name, hf, path, long = model
    eng = _engine(path, "f32")
    for ids in ([0], long[:11], long):
        _assert_close(f"{name}/{len(ids)} tokens", eng.logits(ids), _hf_logits(hf, ids), 1e-3)


def _selection_margins(hf, ids):
    """Per learned-routing layer and token: the gap between the k-th and (k+1)-th selection
    score (score + correction bias) in transformers, relative to the scores' spread."""
    out, hooks = {}, []
    k = hf.config.num_experts_per_tok

    def grab(i):
        def hook(mod, args, res):
            logits = res[0].float()
            score = torch.sqrt(torch.nn.functional.softplus(logits)) + mod.e_score_correction_bias
            top = score.topk(k + 1, dim=-1).values
            out[i] = ((top[:, k - 1] - top[:, k]) / (score.max(-1).values - score.min(-1).values)).numpy()
        return hook
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp.gate, "e_score_correction_bias"):
            hooks.append(layer.mlp.gate.register_forward_hook(grab(i)))
    try:
        _hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def test_half_cache_matches_until_a_router_near_tie(model):
    # A half cache moves router scores by ~1e-3 of their spread: where two experts' selection
    # scores are that close, the token may take the other one, and every later token reads the
    # changed row. Up to the first token whose experts differ from the float cache's, logits stay
    # within 1e-2 of the range; that token must be a near-tie of transformers' own router.
    name, hf, path, long = model
    half, exact = _engine(path, "f16"), _engine(path, "f32")
    ids = long
    ours, ref = half.logits(ids), _hf_logits(hf, ids)
    first, where = len(ids), None
    for layer, (a, b) in enumerate(zip(half.routing(ids), exact.routing(ids))):
        a, b = np.sort(np.array(a).reshape(len(ids), -1), 1), np.sort(np.array(b).reshape(len(ids), -1), 1)
        flips = np.nonzero(np.any(a != b, 1))[0]
        if len(flips) and flips[0] < first:
            first, where = int(flips[0]), layer
    _assert_close(f"{name}/f16 before token {first}", ours[:first], ref[:first], 1e-2)
    if where is not None:
        margin = float(_selection_margins(hf, ids)[where][first])
        assert margin < 1e-2, f"{name}/f16: token {first} changed experts in layer {where} at margin {margin:.2e}"


def test_greedy_matches_transformers(model):
    name, hf, path, long = model
    ids = long[:40]
    ours = _engine(path).generate(ids, max_tokens=24, temperature=0, ignore_eos=True).token_ids
    with torch.no_grad():
        for i, tok in enumerate(ours):
            logits = hf(torch.tensor([ids + ours[:i]])).logits[0, -1].float().numpy()
            if tok == int(logits.argmax()):
                continue
            top2 = np.sort(logits)[-2:]
            margin = float(top2[1] - top2[0]) / float(logits.max() - logits.min())
            assert margin < NEAR_TIE and logits[tok] >= top2[0], (
                f"{name}: greedy token {i} is {tok}, transformers' {int(logits.argmax())} (margin {margin:.2e})")
            return


def test_routing_matches_transformers(model):
    name, hf, path, long = model
    ids = long[:64]
    captured = {}
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, args, i=i: captured.__setitem__(i, args[1].clone()))
             for i, layer in enumerate(hf.model.layers)]
    try:
        _hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    ours = _engine(path).routing(ids)
    k = hf.config.num_experts_per_tok
    assert len(captured) == hf.config.num_hidden_layers
    for layer, sel in captured.items():
        ref = [set(r) for r in sel.reshape(len(ids), k).tolist()]
        got = [set(r) for r in np.array(ours[layer]).reshape(len(ids), k).tolist()]
        assert got == ref, f"{name} layer {layer} ({hf.config.mlp_layer_types[layer]}): experts differ"


def test_chunked_prefill_and_batching_change_nothing(model):
    # The compressors' unfinished windows and the indexer's picks live in the cache between
    # forwards: prefill in chunks of 5 (never aligned with the ratios) must give the logits of one
    # forward, and so must several sequences decoded side by side.
    name, hf, path, long = model
    ids = long[:70]
    full = _engine(path).logits(ids)
    chunked = _engine(path, max_batch_tokens=5).logits(ids)
    np.testing.assert_allclose(chunked, full, rtol=0, atol=1e-4 * float(full.max() - full.min()))
    eng = _engine(path)
    prompts = [long[:13], long[20:41], long[50:52], long[58:88]]
    alone = [eng.generate(p, max_tokens=12, temperature=0, ignore_eos=True).token_ids for p in prompts]
    batched = _engine(path, max_batch_tokens=7)
    core = batched._core
    got = {core.add_request(p, 12, 0.0, 1, 1.0, 0.0, 0, [], True): [] for p in prompts}
    order = list(got)
    while core.has_unfinished():
        for ev in native.step(core):
            got[ev.request_id].append(ev.token)
    assert [got[r] for r in order] == alone
    assert batched.stats()["free_kv_tokens"] == batched.stats()["kv_tokens"]


def test_cache_bytes_per_token(model):
    # Per token and layer: 1/ratio of a compressed row (512-wide in the real model), plus the
    # indexer's key every 4 tokens; the window and the compressors' pending rows are per
    # sequence, not per token.
    name, hf, path, long = model
    c = hf.config
    expected = 0
    for kind in c.layer_types:
        if kind == "sliding_attention":
            continue
        r = c.compress_rates[kind]
        expected += (c.head_dim * 2 + r - 1) // r
        if kind == "compressed_sparse_attention":
            expected += (c.index_head_dim * 2 + r - 1) // r
    assert _engine(path, "f16").stats()["kv_bytes_per_token"] == expected


# -- llama.cpp's own conversion ------------------------------------------------------------------
LLAMACPP = Path(__file__).parent / "fixtures" / "deepseek4"


def _exact_model_of(path):
    """transformers' model of the fixture with every weight replaced by the GGUF's own tensor,
    dequantized by the `gguf` package (Q8_0, BF16, MXFP4): the exact float forward of that file."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize
    from test_convert_deepseek4 import expected_tensors

    model = v4.make_model()
    sd = model.state_dict()
    views = {k: v.numpy() for k, v in sd.items()}
    F = model.config.moe_intermediate_size
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    with torch.no_grad():
        for name, want in expected_tensors(model).items():
            t = tensors[name]
            if t.tensor_type == gguf.GGMLQuantizationType.I32:
                assert np.array_equal(np.asarray(t.data).reshape(want.shape), want), name
                continue
            x = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(want.shape))
            key = next((k for k, v in views.items() if v.shape == want.shape and np.shares_memory(v, want)), None)
            layer = f"model.layers.{name.split('.')[1]}.mlp.experts." if name.startswith("blk.") else ""
            if key is not None:
                sd[key].copy_(x)
            elif name.endswith("ffn_gate_exps.weight"):
                sd[layer + "gate_up_proj"][:, :F] = x
            elif name.endswith("ffn_up_exps.weight"):
                sd[layer + "gate_up_proj"][:, F:] = x
            else:
                assert name.endswith("ffn_down_exps.weight"), name
                sd[layer + "down_proj"].copy_(x)
    return model


def test_llamacpp_conversion_matches_llamacpp_and_the_exact_forward():
    # llama.cpp's converter made this file of the official-layout checkpoint (FP8 weights as
    # Q8_0, routers and compressors BF16, experts MXFP4). Both engines multiply Q8_0 and MXFP4
    # weights with activations rounded to 8 bits, which moves logits by ~1% of their range
    # against the exact forward of the same weights; so the bar is relative: TensorFold is as
    # close to the exact forward as llama.cpp is (measured: mean |diff| 0.171 against 0.177), and
    # the two engines agree with each other where no routing near-tie intervenes (the start).
    path = LLAMACPP / "llamacpp.gguf"
    ids = v4.prompt_ids(300)
    theirs = np.load(LLAMACPP / "llamacpp-logits.npy")
    ours = _engine(str(path)).logits(ids)
    with torch.no_grad():
        exact = _exact_model_of(path)(torch.tensor([ids])).logits[0].numpy()
    ours_err, their_err = np.abs(ours - exact).mean(), np.abs(theirs - exact).mean()
    assert ours_err <= 1.05 * their_err, f"mean |ours - exact| {ours_err:.4f}, llama.cpp's {their_err:.4f}"
    span = float(theirs.max() - theirs.min())
    assert np.abs(ours[:4] - theirs[:4]).max() / span < 0.02
    agree = lambda x: float(np.mean(x.argmax(-1) == exact.argmax(-1)))  # noqa: E731
    print(f"argmax agreement with the exact forward: ours {agree(ours):.3f}, llama.cpp {agree(theirs):.3f}")
    assert agree(ours) >= agree(theirs) - 0.03


def test_tp2_equals_tp1_bit_for_bit(model):
    # TP=2: each rank holds half of the output groups with their query heads; the shared row, the
    # compressors and the indexer are computed on both. In compatible mode TP=1 splits the one
    # sum TP=2 splits (the grouped output's mix) at the same place: logits, greedy tokens and
    # routing are identical bit for bit.
    from test_tp import Pair

    name, hf, path, long = model
    if hf.config.o_groups % 2:  # 5 groups: no even split; refused by name, before anything runs
        with pytest.raises(tensorfold._core.UnsupportedError, match="cannot split the 5 output groups"):
            tensorfold._core.plan_memory(path, tp=2, rank=0)
        return
    ids = long[:70]
    solo = tensorfold.Engine(path, threads=1, context=256, tp_compatible=True)
    ref = solo.logits(ids)
    ref_tokens = solo.generate(ids, max_tokens=12, temperature=0, ignore_eos=True).token_ids
    pair = Pair(path)
    try:
        assert np.array_equal(pair.engine.logits(ids), ref)
        assert pair.engine.generate(ids, max_tokens=12, temperature=0, ignore_eos=True).token_ids == ref_tokens
        assert pair.engine.routing(ids) == solo.routing(ids)
    finally:
        err = pair.close()
    assert pair.worker.returncode == 0, err


def test_prefix_cache_is_exact(model):
    # A second prompt sharing a prefix with a finished one reuses its cached blocks in every
    # stream (window rows, the compressors' pending rows, compressed entries, indexer keys), up
    # to a length every stream's blocks align to (16 entries: 16 tokens of window rows, 64 of
    # CSA entries, 128 of ratio-8 entries, 2048 of ratio-128 ones); the continuation is the one a
    # cold engine gives.
    name, hf, path, long = model
    shared = long[:150] if len(long) >= 150 else (long * 2)[:150]
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    cold = _engine(path, prefix_cache=False).generate(b, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    warm = _engine(path)
    warm.generate(a, max_tokens=4, temperature=0, ignore_eos=True)
    got = warm.generate(b, max_tokens=10, temperature=0, ignore_eos=True).token_ids
    assert got == cold
    ratios = [hf.config.compress_rates[k] for k in hf.config.layer_types if k != "sliding_attention"]
    align = 16 * max(ratios)
    assert warm.stats()["prefix_cached_tokens"] == (len(shared) // align) * align


def test_next_token_prediction_layer_is_loaded_and_kept(tmp_path):
    # DeepSeek's release layout carries an MTP layer; the converter keeps it as llama.cpp's
    # nextn layer (blk.4.*), and the engine loads it beside the 4 ordinary layers without
    # running it. Its FP4 experts (MXFP4) meet 8-bit activations, so the logits follow the exact
    # forward of the file's weights closely only until a routing near-tie (see above): the first
    # positions are checked.
    official = Path(__file__).parent / "fixtures" / "deepseek4" / "official"
    with_mtp = tmp_path / "mtp.gguf"
    convert(str(official), str(with_mtp), "f32", progress=False)
    eng = _engine(str(with_mtp))
    assert eng.config["n_layer"] == 4 and eng.config["nextn_layers"] == 1
    ids = v4.prompt_ids(40)
    exact = _exact_model_of(with_mtp)
    with torch.no_grad():
        ref = exact(torch.tensor([ids])).logits[0].numpy()
    _assert_close("official+mtp", eng.logits(ids)[:4], ref[:4], 2e-2)
