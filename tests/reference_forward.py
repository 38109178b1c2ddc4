"""An independent float64 forward pass over a GGUF file: the numeric oracle for quantized files.

It shares no code with TensorFold: the file is read with the ``gguf`` package
(``gguf.GGUFReader``) and every tensor is turned into numbers by ``gguf.quants.dequantize``
(F32/F16/BF16, the legacy and K-quants, IQ1_S … IQ4_XS, TQ1_0/TQ2_0, MXFP4 — whatever that
package knows), then cast to float64. Everything after that is plain numpy in float64, so the
only differences between an engine's logits and these are the engine's own arithmetic
(activation quantization, float32 accumulation, an F16 KV cache, …) — never the weights.

Architectures (llama.cpp's graph for each, written from the model definitions, not copied):

    llama     NORM rope (adjacent pairs), optional MoE (Mixtral: softmax, top-k, renormalised)
    qwen2     NEOX rope (halves), q/k/v biases
    qwen3     NEOX rope, per-head RMSNorm on q and k before rope
    qwen2moe  qwen2 attention; softmax router, top-k, *not* renormalised (unless the file says
              expert_weights_norm = true); a shared expert whose output is scaled by
              sigmoid(ffn_gate_inp_shexp · x)
    qwen3moe  qwen3 attention; softmax router, top-k, renormalised

Common to all: token embedding lookup; pre-norm residual blocks with RMSNorm
(x / sqrt(mean(x²) + eps) · w); rotary embedding with theta_i = pos · base^(-2i / n_rot) on the
first n_rot dimensions of each head; grouped-query causal attention with scale 1/sqrt(head_dim);
SwiGLU feed-forward silu(x·Wg) ⊙ (x·Wu) · Wd; final RMSNorm; LM head ``output.weight`` or, when
absent, the tied ``token_embd.weight``.

Split files (``name-00001-of-0000N.gguf``): pass any part; all parts are read.

    from reference_forward import ReferenceModel
    ref = ReferenceModel("model-Q4_K_M.gguf")
    logits = ref.logits([1, 2, 3])            # float64, shape [3, n_vocab]
    logits, routing = ref.forward(ids, return_routing=True)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

ROPE_MODE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "qwen2moe": "neox", "qwen3moe": "neox"}
# llama.cpp's graphs hard-code whether the top-k router weights are renormalised; a file may
# state it in {arch}.expert_weights_norm (TensorFold's converter writes it), which wins.
DEFAULT_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_parts(path: str) -> list[str]:
    """All part paths of a split GGUF given any part, or [path] for a single file."""
    m = _SPLIT_RE.match(os.path.basename(path))
    if not m:
        return [path]
    d = os.path.dirname(path)
    n = int(m["count"])
    return [os.path.join(d, f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    return f.contents()


@dataclass
class Hparams:
    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_mode: str
    eps: float
    n_expert: int
    n_expert_used: int
    norm_topk: bool
    expert_scale: float


class ReferenceModel:
    """Float64 weights of a GGUF model (dequantized once) and a forward pass over them."""

    def __init__(self, path: str):
        import gguf

        self.path = path
        self.readers = [gguf.GGUFReader(p) for p in split_parts(path)]
        md = self.readers[0]
        arch = str(_field(md, "general.architecture"))
        if arch not in ROPE_MODE:
            raise NotImplementedError(f"reference forward: architecture {arch!r} not implemented")

        def kv(name, default=None):
            v = _field(md, f"{arch}.{name}")
            return default if v is None else v

        n_embd = int(kv("embedding_length"))
        n_head = int(kv("attention.head_count"))
        head_dim = int(kv("attention.key_length", n_embd // n_head))
        if int(kv("attention.value_length", head_dim)) != head_dim:
            raise NotImplementedError("key_length != value_length")
        scaling = _field(md, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise NotImplementedError(f"rope scaling {scaling!r}")
        n_expert = int(kv("expert_count", 0))
        norm = kv("expert_weights_norm", None)
        self.hp = Hparams(
            arch=arch, n_embd=n_embd, n_layer=int(kv("block_count")), n_head=n_head,
            n_head_kv=int(kv("attention.head_count_kv", n_head)), head_dim=head_dim,
            n_rot=int(kv("rope.dimension_count", head_dim)), rope_base=float(kv("rope.freq_base", 10000.0)),
            rope_mode=ROPE_MODE[arch], eps=float(kv("attention.layer_norm_rms_epsilon")),
            n_expert=n_expert, n_expert_used=int(kv("expert_used_count", 0)),
            norm_topk=bool(DEFAULT_NORM_TOPK.get(arch, True) if norm is None else norm),
            expert_scale=float(kv("expert_weights_scale", 0.0) or 0.0),
        )
        self.types: dict[str, str] = {}
        self.w: dict[str, np.ndarray] = {}
        for r in self.readers:
            for t in r.tensors:
                self.types[t.name] = t.tensor_type.name
                self.w[t.name] = self._dequantize(t)
        self.n_vocab = self.w["token_embd.weight"].shape[0]

    @staticmethod
    def _dequantize(t) -> np.ndarray:
        from gguf.quants import dequantize

        ne = [int(d) for d in t.shape]  # ggml order: ne0 (row length) first
        x = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        return x.reshape(list(reversed(ne)))  # numpy order: [..., rows, ne0]

    # ------------------------------------------------------------------ building blocks
    def _get(self, name: str) -> np.ndarray | None:
        return self.w.get(name)

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.hp.eps) * w

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: [n_tok, n_heads, head_dim]; rotates the first n_rot dims of every head."""
        n_rot = self.hp.n_rot
        half = n_rot // 2
        inv = self.hp.rope_base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
        ang = pos[:, None].astype(np.float64) * inv[None, :]  # [n_tok, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        out = x.copy()
        if self.hp.rope_mode == "norm":
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        else:
            a, b = x[..., :half], x[..., half:n_rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:n_rot] = a * sin + b * cos
        return out

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        b = self._get(name + ".bias")
        return y if b is None else y + b

    def _attention(self, h: np.ndarray, il: int, pos: np.ndarray) -> np.ndarray:
        hp, p = self.hp, f"blk.{il}."
        n = h.shape[0]
        q = self._linear(h, p + "attn_q").reshape(n, hp.n_head, hp.head_dim)
        k = self._linear(h, p + "attn_k").reshape(n, hp.n_head_kv, hp.head_dim)
        v = self._linear(h, p + "attn_v").reshape(n, hp.n_head_kv, hp.head_dim)
        qn, kn = self._get(p + "attn_q_norm.weight"), self._get(p + "attn_k_norm.weight")
        if qn is not None:
            q = self._rms(q, qn)
        if kn is not None:
            k = self._rms(k, kn)
        q, k = self._rope(q, pos), self._rope(k, pos)
        group = hp.n_head // hp.n_head_kv
        k = np.repeat(k, group, axis=1)  # query head j reads KV head j // group
        v = np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hp.head_dim)
        s = np.where(np.tril(np.ones((n, n), dtype=bool))[None], s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", s, v).reshape(n, hp.n_head * hp.head_dim)
        return self._linear(o, p + "attn_output")

    @staticmethod
    def _swiglu(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, wd: np.ndarray) -> np.ndarray:
        g = x @ wg.T
        return ((g / (1.0 + np.exp(-g))) * (x @ wu.T)) @ wd.T

    def _ffn(self, h: np.ndarray, il: int, routing: list | None) -> np.ndarray:
        hp, p = self.hp, f"blk.{il}."
        if hp.n_expert == 0 or p + "ffn_gate_inp.weight" not in self.w:
            return self._swiglu(h, self.w[p + "ffn_gate.weight"], self.w[p + "ffn_up.weight"],
                                self.w[p + "ffn_down.weight"])
        scores = h @ self.w[p + "ffn_gate_inp.weight"].T  # [n_tok, n_expert]
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        k = hp.n_expert_used
        # stable sort on -prob: among exact ties the lower expert id comes first
        order = np.argsort(-probs, axis=-1, kind="stable")
        sel = order[:, :k]
        wsel = np.take_along_axis(probs, sel, axis=-1)
        if hp.norm_topk:
            wsel = wsel / wsel.sum(axis=-1, keepdims=True)
        if hp.expert_scale not in (0.0, 1.0):
            wsel = wsel * hp.expert_scale
        gate, up, down = (self.w[p + f"ffn_{r}_exps.weight"] for r in ("gate", "up", "down"))
        out = np.zeros_like(h)
        for e in range(hp.n_expert):
            rows, slot = np.nonzero(sel == e)  # tokens that chose expert e, and in which slot
            if len(rows):
                out[rows] += wsel[rows, slot][:, None] * self._swiglu(h[rows], gate[e], up[e], down[e])
        if p + "ffn_gate_shexp.weight" in self.w:
            sh = self._swiglu(h, self.w[p + "ffn_gate_shexp.weight"], self.w[p + "ffn_up_shexp.weight"],
                              self.w[p + "ffn_down_shexp.weight"])
            g = self._get(p + "ffn_gate_inp_shexp.weight")
            if g is not None:
                sh = sh / (1.0 + np.exp(-(h @ g.reshape(-1))))[:, None]
            out += sh
        if routing is not None:
            srt = np.sort(scores, axis=-1)[:, ::-1]
            # gap between the last chosen and the first unchosen router score (logit units):
            # a small gap means a tiny perturbation could change which experts run
            gap = srt[:, k - 1] - srt[:, k] if k < hp.n_expert else np.full(len(h), np.inf)
            routing.append({"experts": sel.tolist(), "weights": wsel, "gap": gap})
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, ids, return_routing: bool = False):
        ids = np.asarray(list(ids), dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= self.n_vocab:
            raise ValueError("ids must be a non-empty list of token ids within the vocabulary")
        pos = np.arange(len(ids))
        x = self.w["token_embd.weight"][ids].copy()
        routing: list | None = [] if return_routing else None
        for il in range(self.hp.n_layer):
            p = f"blk.{il}."
            x = x + self._attention(self._rms(x, self.w[p + "attn_norm.weight"]), il, pos)
            x = x + self._ffn(self._rms(x, self.w[p + "ffn_norm.weight"]), il, routing)
        x = self._rms(x, self.w["output_norm.weight"])
        head = self.w.get("output.weight", self.w["token_embd.weight"])
        logits = x @ head.T
        return (logits, routing) if return_routing else logits

    def logits(self, ids) -> np.ndarray:
        return self.forward(ids)


# ---------------------------------------------------------------------- comparison metrics

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kld(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per-position KL(ref || other) in nats."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def router_near_ties(routing: list | None, n_tokens: int, tol: float) -> np.ndarray:
    """Positions whose output may depend on a router near tie: some MoE layer's last chosen and
    first unchosen router scores are within `tol`. An engine that rounds its activations may
    pick the other expert there — legitimately, and with a large effect on that position — so
    comparisons skip these positions (and check the routing everywhere else). A near tie in the
    last layer affects only its own position; one in an earlier layer also reaches every later
    position through the following layers' attention, so from there on everything is skipped."""
    mask = np.zeros(n_tokens, dtype=bool)
    layers = routing or []
    for i, layer in enumerate(layers):
        tied = np.asarray(layer["gap"]) < tol
        if i == len(layers) - 1:
            mask |= tied
        elif tied.any():
            mask[int(np.argmax(tied)):] = True
    return mask


def top2_margin(logits: np.ndarray) -> np.ndarray:
    s = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)
    return s[:, -1] - s[:, -2]


def top1_agreement(ref_logits: np.ndarray, top1: np.ndarray, tie: float) -> np.ndarray:
    """Per position: does the engine's top-1 token agree with the reference?

    A position counts as agreeing when the engine picked the reference's argmax, or, at a near
    tie, any token whose reference logit is within `tie` of the reference maximum (for such a
    token the reference itself cannot tell the two apart at the engine's precision)."""
    ref = np.asarray(ref_logits, dtype=np.float64)
    top1 = np.asarray(top1, dtype=np.int64)
    chosen = np.take_along_axis(ref, top1[:, None], axis=-1)[:, 0]
    return (top1 == ref.argmax(axis=-1)) | (ref.max(axis=-1) - chosen <= tie)
