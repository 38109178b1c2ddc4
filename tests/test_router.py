"""MoE expert routing (_core.moe_route) against Hugging Face transformers' own MoE blocks.

Each HF MoE block (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3; DeepSeek-V4's two
routers, learned and hash, are run on their own) is built from a
small random config and run on random hidden states; a forward hook on the block's router
submodule (`block.gate`) captures the router logits, combine weights and expert ids the block
actually used. The same logits go through _core.moe_route: expert sets must be identical per
token and weights equal within 1e-5 relative. HF's DeepSeek routers use topk(sorted=False), so
those comparisons are order-insensitive; the Qwen / Mixtral ones use sorted top-k and are
compared in order.

The fast path is also checked against the double-precision reference over many random cases,
and invalid configurations must raise ValueError. Data is continuous random (no exact ties:
torch.topk's tie order is unspecified; ours picks the lower expert id).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tensorfold import _core

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN = 24
T_SIZES = [1, 3, 17, 64]


def _small(config_cls, **kw):
    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=16,
        moe_intermediate_size=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=1,
        vocab_size=32,
    )
    common.update(kw)
    return config_cls(**common)


def _run_block(block, T, seed):
    """Runs the HF block on random hidden states; returns (logits, ids, weights) as numpy, taken
    from the block's router while the block runs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(HIDDEN))
    block.eval()
    captured = {}

    def hook(_module, _inputs, outputs):
        captured["out"] = outputs

    handle = block.gate.register_forward_hook(hook)
    hidden = torch.randn(1, T, HIDDEN, generator=g)
    try:
        with torch.no_grad():
            block(hidden)
    finally:
        handle.remove()
    logits, weights, ids = (o.detach() for o in captured["out"])
    # The logits the router saw are hidden @ gate.weight.T in float32.
    ref_logits = hidden.reshape(T, HIDDEN).numpy() @ block.gate.weight.detach().numpy().T
    np.testing.assert_allclose(logits.numpy(), ref_logits, rtol=1e-5, atol=1e-5)
    return (
        np.ascontiguousarray(logits.numpy(), dtype=np.float32),
        ids.numpy().astype(np.int64),
        weights.to(torch.float32).numpy(),
    )


def _compare(hf_ids, hf_w, ids, w, ordered):
    assert ids.shape == hf_ids.shape and w.shape == hf_w.shape
    if ordered:
        np.testing.assert_array_equal(ids, hf_ids)
        np.testing.assert_allclose(w, hf_w, rtol=1e-5, atol=1e-12)
        return
    o_hf = np.argsort(hf_ids, axis=1)
    o = np.argsort(ids, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, o, 1), np.take_along_axis(hf_ids, o_hf, 1))
    np.testing.assert_allclose(
        np.take_along_axis(w, o, 1), np.take_along_axis(hf_w, o_hf, 1), rtol=1e-5, atol=1e-12
    )


def _sqrt_softplus(x):
    x = x.astype(np.float64)
    return np.sqrt(np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))))


def _check_best_first(ids, logits, bias=None, gating="softmax"):
    """Our ids come best first by selection score."""
    s = {"sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "sqrtsoftplus": _sqrt_softplus}.get(
        gating, lambda x: x)(logits.astype(np.float64))
    if gating == "softmax" and bias is not None:
        e = np.exp(s - s.max(1, keepdims=True))
        s = e / e.sum(1, keepdims=True)
    if bias is not None:
        s = s + bias
    chosen = np.take_along_axis(s, ids.astype(np.int64), 1)
    assert np.all(np.diff(chosen, axis=1) <= 0)


# --- Qwen2-MoE / Qwen3-MoE: softmax -> top-k, optional renormalisation -----------------------

@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("n_expert,k", [(5, 2), (7, 2), (7, 3), (60, 4)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("T", T_SIZES)
def test_qwen_moe_matches_hf(family, n_expert, k, norm, T):
    if family == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Cfg
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = _small(Cfg, num_experts=n_expert, num_experts_per_tok=k, norm_topk_prob=norm,
                     shared_expert_intermediate_size=8)
    else:
        from transformers import Qwen3MoeConfig as Cfg
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = _small(Cfg, num_experts=n_expert, num_experts_per_tok=k, norm_topk_prob=norm)
    block = Block(cfg)
    logits, hf_ids, hf_w = _run_block(block, T, seed=n_expert * 100 + k * 10 + T + norm)
    for reference in (False, True):
        ids, w = _core.moe_route(logits, k, "softmax", norm_topk=norm, reference=reference)
        _compare(hf_ids, hf_w, ids, w, ordered=True)
        _check_best_first(ids, logits)


# --- Mixtral: top-k, softmax over the chosen (= softmax + renormalisation) -------------------

@pytest.mark.parametrize("n_expert,k", [(5, 2), (7, 2), (8, 2), (9, 3)])
@pytest.mark.parametrize("T", T_SIZES)
def test_mixtral_matches_hf(n_expert, k, T):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = _small(MixtralConfig, num_local_experts=n_expert, num_experts_per_tok=k)
    block = MixtralSparseMoeBlock(cfg)
    logits, hf_ids, hf_w = _run_block(block, T, seed=7 * n_expert + 3 * k + T)
    for reference in (False, True):
        ids, w = _core.moe_route(logits, k, "softmax", norm_topk=True, reference=reference)
        _compare(hf_ids, hf_w, ids, w, ordered=True)


# --- DeepSeek-V3: sigmoid, selection bias, group-limited top-k (sum of top-2 per group) ------

@pytest.mark.parametrize(
    "n_expert,n_group,topk_group,k",
    [(16, 4, 2, 4), (16, 1, 1, 4), (32, 8, 3, 5), (21, 7, 3, 2), (16, 4, 4, 3), (18, 3, 1, 6)],
)
@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0), (True, 1.0), (False, 0.75)])
@pytest.mark.parametrize("T", T_SIZES)
def test_deepseek_v3_matches_hf(n_expert, n_group, topk_group, k, norm, scale, T):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = _small(DeepseekV3Config, n_routed_experts=n_expert, n_group=n_group, topk_group=topk_group,
                 num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=scale,
                 n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8,
                 qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    block = DeepseekV3MoE(cfg)
    rng = np.random.default_rng(n_expert * 1000 + T)
    bias = rng.uniform(-0.2, 0.2, n_expert).astype(np.float32)
    block.gate.e_score_correction_bias.copy_(torch.from_numpy(bias))
    logits, hf_ids, hf_w = _run_block(block, T, seed=n_expert + 31 * T + int(norm))
    for reference in (False, True):
        ids, w = _core.moe_route(logits, k, "sigmoid", norm_topk=norm, scale=scale, bias=bias,
                                 n_group=n_group, n_group_used=topk_group, reference=reference)
        _compare(hf_ids, hf_w, ids, w, ordered=False)
        _check_best_first(ids, logits, bias, "sigmoid")


# --- DeepSeek-V2: softmax, greedy or group-limited greedy (group score = best prob) ----------

@pytest.mark.parametrize(
    "method,n_expert,n_group,topk_group,k",
    [("greedy", 7, 1, 1, 2), ("greedy", 16, 1, 1, 6), ("group_limited_greedy", 16, 4, 2, 4),
     ("group_limited_greedy", 30, 5, 2, 6), ("group_limited_greedy", 21, 7, 1, 3)],
)
@pytest.mark.parametrize("scale", [1.0, 1.5])
@pytest.mark.parametrize("T", T_SIZES)
def test_deepseek_v2_matches_hf(method, n_expert, n_group, topk_group, k, scale, T):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    cfg = _small(DeepseekV2Config, n_routed_experts=n_expert, n_group=n_group, topk_group=topk_group,
                 num_experts_per_tok=k, topk_method=method, routed_scaling_factor=scale,
                 n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=8,
                 qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    block = DeepseekV2Moe(cfg)
    assert block.gate.topk_method == method
    logits, hf_ids, hf_w = _run_block(block, T, seed=n_expert * 7 + T + k)
    for reference in (False, True):
        ids, w = _core.moe_route(logits, k, "softmax", scale=scale, n_group=n_group,
                                 n_group_used=topk_group, reference=reference)
        _compare(hf_ids, hf_w, ids, w, ordered=False)
        _check_best_first(ids, logits)


# --- DeepSeek-V4: sqrtsoftplus scores, selection bias, renormalised; hash routing by token id ----

@pytest.mark.parametrize("n_expert,k", [(8, 2), (16, 6), (33, 4)])
@pytest.mark.parametrize("scale", [1.0, 1.5])
@pytest.mark.parametrize("T", T_SIZES)
def test_deepseek_v4_matches_hf(n_expert, k, scale, T):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter

    cfg = DeepseekV4Config(hidden_size=HIDDEN, num_local_experts=n_expert, num_experts_per_tok=k,
                           routed_scaling_factor=scale, num_hidden_layers=2, vocab_size=50)
    g = torch.Generator().manual_seed(n_expert * 10 + k + T)
    hidden = torch.randn(1, T, HIDDEN, generator=g)
    learned, hashed = DeepseekV4TopKRouter(cfg), DeepseekV4HashRouter(cfg)
    bias = torch.rand(n_expert, generator=g) * 0.6 - 0.3
    tid2eid = torch.stack([torch.randperm(n_expert, generator=g)[:k] for _ in range(50)])
    input_ids = torch.randint(0, 50, (1, T), generator=g)
    with torch.no_grad():
        for router in (learned, hashed):
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) / np.sqrt(HIDDEN))
        learned.e_score_correction_bias.copy_(bias)
        hashed.tid2eid.copy_(tid2eid)
        logits, hf_w, hf_ids = learned(hidden)
        h_logits, h_w, h_ids = hashed(hidden, input_ids)
    logits = np.ascontiguousarray(logits.numpy(), dtype=np.float32)
    fixed = np.ascontiguousarray(h_ids.numpy(), dtype=np.int32)
    for reference in (False, True):
        # HF's top-k is unsorted: compared as sets
        ids, w = _core.moe_route(logits, k, "sqrtsoftplus", norm_topk=True, scale=scale, bias=bias.numpy(),
                                 reference=reference)
        _compare(hf_ids.numpy().astype(np.int64), hf_w.numpy(), ids, w, ordered=False)
        _check_best_first(ids, logits, bias.numpy(), "sqrtsoftplus")
        # hash routing: the table's ids in its order, weights from the scores at them
        ids, w = _core.moe_route(np.ascontiguousarray(h_logits.numpy()), k, "sqrtsoftplus", norm_topk=True,
                                 scale=scale, reference=reference, fixed=fixed)
        _compare(h_ids.numpy().astype(np.int64), h_w.numpy(), ids, w, ordered=True)


# --- fast path vs double-precision reference --------------------------------------------------

def _random_cases(gatings=("softmax", "sigmoid")):
    cases = []
    for n_expert, n_group in [(1, 1), (2, 1), (5, 1), (7, 1), (16, 4), (16, 16), (24, 8), (33, 3), (64, 8), (160, 1)]:
        per = n_expert // n_group
        for gating, norm, with_bias in itertools.product(gatings, [False, True], [False, True]):
            for n_group_used in sorted({1, max(1, n_group // 2), n_group}):
                for k in sorted({1, min(2, n_group_used * per), n_group_used * per}):
                    cases.append((n_expert, n_group, n_group_used, k, gating, norm, with_bias))
    return cases


@pytest.mark.parametrize("T", T_SIZES)
@pytest.mark.parametrize("gatings", [("softmax", "sigmoid"), ("sqrtsoftplus",)])
def test_fast_matches_reference(T, gatings):
    rng = np.random.default_rng(T if "softmax" in gatings else T + 1000)
    for i, (n_expert, n_group, n_group_used, k, gating, norm, with_bias) in enumerate(_random_cases(gatings)):
        # Sigmoid logits stay moderate: float32 sigmoid saturates to exactly 1.0 near |x| > 17, and
        # saturated group sums then tie in float (lower group wins) but not in double.
        spread = rng.choice([0.5, 2.0, 8.0] if gating == "softmax" else [0.5, 2.0, 4.0])
        logits = (rng.standard_normal((T, n_expert)) * spread).astype(np.float32)
        bias = rng.uniform(-0.3, 0.3, n_expert).astype(np.float32) if with_bias else None
        scale = float(rng.choice([1.0, 2.5, 16.0]))
        kw = dict(gating=gating, norm_topk=norm, scale=scale, bias=bias, n_group=n_group, n_group_used=n_group_used)
        ids_f, w_f = _core.moe_route(logits, k, **kw)
        ids_r, w_r = _core.moe_route(logits, k, reference=True, **kw)
        assert ids_f.dtype == np.int32 and w_f.dtype == np.float32 and ids_f.shape == (T, k)
        if gating == "sqrtsoftplus" and with_bias:
            # score + bias is formed in float by the fast path (as HF does), in double by the
            # reference: two keys within float rounding of each other may come in either order.
            # Then the keys at each place agree to rounding, and the rows (same experts) are
            # compared by expert id.
            key = _sqrt_softplus(logits) + bias
            kf, kr = (np.take_along_axis(key, x.astype(np.int64), 1) for x in (ids_f, ids_r))
            np.testing.assert_allclose(kf, kr, rtol=4 * 2.0 ** -24, err_msg=f"case {i}: {kw}, k={k}")
            of, orf = np.argsort(ids_f, 1), np.argsort(ids_r, 1)
            ids_f, w_f = np.take_along_axis(ids_f, of, 1), np.take_along_axis(w_f, of, 1)
            ids_r, w_r = np.take_along_axis(ids_r, orf, 1), np.take_along_axis(w_r, orf, 1)
        np.testing.assert_array_equal(ids_f, ids_r, err_msg=f"case {i}: {kw}, k={k}")
        np.testing.assert_allclose(w_f, w_r, rtol=1e-6, atol=1e-7 * scale, err_msg=f"case {i}: {kw}, k={k}")
        assert np.all((ids_f >= 0) & (ids_f < n_expert))
        assert all(len(set(row)) == k for row in ids_f.tolist())
        if norm:
            np.testing.assert_allclose(w_f.sum(1), scale, rtol=1e-5)


@pytest.mark.parametrize("T", T_SIZES)
def test_fixed_ids_match_reference(T):
    """Hash routing (ids fixed by a table) in every gating, fast path against the reference."""
    rng = np.random.default_rng(100 + T)
    for gating, norm, n_expert, k in itertools.product(["softmax", "sigmoid", "sqrtsoftplus"], [False, True],
                                                       [1, 7, 64], [1, 3]):
        k = min(k, n_expert)
        logits = (rng.standard_normal((T, n_expert)) * 3).astype(np.float32)
        fixed = np.stack([rng.permutation(n_expert)[:k] for _ in range(T)]).astype(np.int32)
        kw = dict(gating=gating, norm_topk=norm, scale=2.5, fixed=fixed,
                  bias=rng.uniform(-1, 1, n_expert).astype(np.float32))  # the bias plays no part
        ids_f, w_f = _core.moe_route(logits, k, **kw)
        ids_r, w_r = _core.moe_route(logits, k, reference=True, **kw)
        np.testing.assert_array_equal(ids_f, fixed)
        np.testing.assert_array_equal(ids_r, fixed)
        np.testing.assert_allclose(w_f, w_r, rtol=1e-6, atol=1e-7 * 2.5)


@pytest.mark.parametrize("reference", [False, True])
def test_fixed_ids_out_of_range_raise(reference):
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError):
        _core.moe_route(logits, 2, reference=reference, fixed=np.array([[0, 8], [1, 2]], np.int32))
    with pytest.raises(ValueError):
        _core.moe_route(logits, 2, reference=reference, fixed=np.array([[0, 1]], np.int32))  # one row for 2 tokens


@pytest.mark.parametrize("reference", [False, True])
def test_exact_ties_pick_lower_id(reference):
    logits = np.zeros((2, 8), np.float32)
    logits[1, [6, 3, 5]] = 1.0
    ids, w = _core.moe_route(logits, 3, reference=reference)
    np.testing.assert_array_equal(ids, [[0, 1, 2], [3, 5, 6]])
    np.testing.assert_allclose(w[0], 1 / 8, rtol=1e-6)
    # Groups tie too: equal group scores keep the lower group.
    ids, _ = _core.moe_route(np.zeros((1, 8), np.float32), 2, "sigmoid", n_group=4, n_group_used=1,
                             reference=reference)
    np.testing.assert_array_equal(ids, [[0, 1]])


def test_zero_tokens_and_dtype_conversion():
    ids, w = _core.moe_route(np.zeros((0, 6), np.float32), 2)
    assert ids.shape == (0, 2) and w.shape == (0, 2)
    x = np.random.default_rng(0).standard_normal((3, 6))  # float64 is converted
    ids64, _ = _core.moe_route(x, 2)
    ids32, _ = _core.moe_route(x.astype(np.float32), 2)
    np.testing.assert_array_equal(ids64, ids32)


# --- invalid configurations -------------------------------------------------------------------

@pytest.mark.parametrize(
    "kw",
    [
        dict(n_used=9),                                      # n_used > n_expert
        dict(n_used=0),
        dict(n_used=2, n_group=3, n_group_used=1),           # 8 % 3 != 0
        dict(n_used=2, n_group=4, n_group_used=5),           # n_group_used > n_group
        dict(n_used=2, n_group=4, n_group_used=0),
        dict(n_used=2, n_group=0),
        dict(n_used=5, n_group=4, n_group_used=2),           # 5 > 2 groups x 2 experts
        dict(n_used=2, bias=np.zeros(7, np.float32)),        # bias of the wrong length
        dict(n_used=2, bias=np.zeros((2, 4), np.float32)),
        dict(n_used=2, gating="relu"),
        dict(n_used=2, scale=float("nan")),
    ],
)
@pytest.mark.parametrize("reference", [False, True])
def test_invalid_configs_raise(kw, reference):
    logits = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError):
        _core.moe_route(logits, reference=reference, **kw)


@pytest.mark.parametrize("shape", [(8,), (2, 0), (1, 2, 4)])
def test_invalid_logits_raise(shape):
    with pytest.raises(ValueError):
        _core.moe_route(np.zeros(shape, np.float32), 1)
