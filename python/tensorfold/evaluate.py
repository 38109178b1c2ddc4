"""`tensorfold eval`: how close a (quantized) model is to its reference on a text.

The text is tokenized once (with the model's tokenizer, which must agree with the
reference's) and cut into chunks of `ctx` tokens, each starting with BOS where the model adds
one, as llama.cpp's llama-perplexity does. Each chunk runs through both models; the second
half of every chunk is scored (each position then has at least ctx/2 tokens of context):

- perplexity: exp(mean negative log-likelihood of the next token), for the model and the
  reference, with the standard error of the model's mean NLL;
- KL divergence KL(reference || model) of the next-token distributions, per position:
  mean, median, p99 and max;
- same top token: how often both models' most likely next token agree.

Distributions are the log-softmax of the raw logits (temperature 1), in float64.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class EvalResult:
    model: str
    ref: str | None
    text_tokens: int
    ctx: int
    chunks: int
    scored_tokens: int
    ppl: float
    ppl_stderr: float      # of the PPL, from the standard error of the mean NLL
    ppl_ref: float | None = None
    kld_mean: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    same_top: float | None = None  # fraction of positions whose most likely token agrees

    def table(self) -> str:
        rows = [("model", self.model), ("reference", self.ref or "—"),
                ("tokens scored", f"{self.scored_tokens} ({self.chunks} chunks of {self.ctx})"),
                ("perplexity", f"{self.ppl:.4f} ± {self.ppl_stderr:.4f}")]
        if self.ref is not None:
            rows += [("reference perplexity", f"{self.ppl_ref:.4f}"),
                     ("KLD mean", f"{self.kld_mean:.6f}"), ("KLD median", f"{self.kld_median:.6f}"),
                     ("KLD p99", f"{self.kld_p99:.6f}"), ("KLD max", f"{self.kld_max:.6f}"),
                     ("same top token", f"{100 * self.same_top:.2f}%")]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def read_text(path: str, option: str = "--text") -> tuple[bytes, str]:
    """A text file's bytes (for its sha256) and its text (invalid UTF-8 replaced); a missing or
    unreadable file is a ValueError naming the option it came from."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {option} {path}: {e.strerror}") from None
    return raw, raw.decode("utf-8", errors="replace")


def _kld_rows(lr: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """KL(reference || model) per position from float64 log-probabilities."""
    return np.maximum((np.exp(lr) * (lr - lp)).sum(axis=-1), 0.0)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _chunks(ids: list[int], ctx: int, bos: int | None, max_chunks: int | None) -> list[list[int]]:
    n = len(ids) // ctx
    if max_chunks is not None:
        n = min(n, max_chunks)
    out = []
    for c in range(n):
        chunk = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            chunk[0] = bos  # every chunk starts like a document
        out.append(chunk)
    return out


def evaluate(model, text: str, *, ref=None, ctx: int = 512, max_chunks: int | None = None,
             progress: bool = True) -> EvalResult:
    """`model` and `ref`: loaded tensorfold.Engine objects (the reference may be None: then
    only the perplexity is measured)."""
    if ctx < 4:
        raise ValueError(f"ctx must be at least 4 tokens, got {ctx}")
    if ctx > model.context or (ref is not None and ctx > ref.context):
        raise ValueError(f"ctx {ctx} is longer than an engine's context "
                         f"({model.context}{'' if ref is None else f' / {ref.context}'}); load it with a "
                         f"larger context or lower ctx")
    ids = model.tokenize(text, add_special=False)
    if ref is not None:
        probe = text[:20000]
        if ref.tokenizer.vocab_size != model.tokenizer.vocab_size or \
                ref.tokenize(probe, add_special=False) != model.tokenize(probe, add_special=False):
            raise ValueError("the model and the reference tokenize the text differently: KL divergence needs "
                             "the same vocabulary (compare a quantization with its own source model)")
    tok = model.tokenizer
    bos = tok.bos_id if tok.add_bos else None  # as llama-perplexity: BOS only for models that add it
    chunks = _chunks(ids, ctx, bos, max_chunks)
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; give a longer text "
                         f"or a smaller --ctx")
    first = ctx // 2
    nll, nll_ref, kld, same = [], [], [], []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(chunks), desc="eval", unit="chunk", file=sys.stderr)
    try:
        for chunk in chunks:
            target = np.asarray(chunk[first + 1:], dtype=np.int64)
            lp = _log_softmax(np.asarray(model.logits(chunk))[first:-1])
            rows = np.arange(len(target))
            nll.append(-lp[rows, target])
            if ref is not None:
                lr = _log_softmax(np.asarray(ref.logits(chunk))[first:-1])
                nll_ref.append(-lr[rows, target])
                kld.append(_kld_rows(lr, lp))
                same.append(lp.argmax(axis=-1) == lr.argmax(axis=-1))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(ppl=f"{math.exp(np.concatenate(nll).mean()):.3f}")
    finally:
        if bar is not None:
            bar.close()
    nll_all = np.concatenate(nll)
    mean = float(nll_all.mean())
    se = float(nll_all.std(ddof=1) / math.sqrt(len(nll_all))) if len(nll_all) > 1 else 0.0
    res = EvalResult(model=getattr(model, "path", "model"), ref=None if ref is None else getattr(ref, "path", "ref"),
                     text_tokens=len(ids), ctx=ctx, chunks=len(chunks), scored_tokens=int(len(nll_all)),
                     ppl=math.exp(mean), ppl_stderr=math.exp(mean) * se)
    if ref is not None:
        k = np.concatenate(kld)
        res.ppl_ref = math.exp(float(np.concatenate(nll_ref).mean()))
        res.kld_mean, res.kld_median = float(k.mean()), float(np.median(k))
        res.kld_p99, res.kld_max = float(np.percentile(k, 99)), float(k.max())
        res.same_top = float(np.concatenate(same).mean())
    return res


class ReferenceDistributions:
    """The reference model's next-token distributions on a few chunks of a text, kept so that
    many variants of the model can be scored against them without rerunning the reference
    (the quantizer's sensitivity probes). Stored as float32 log-probabilities of the scored
    (second) half of each chunk."""

    def __init__(self, ref, text: str, *, ctx: int, max_chunks: int):
        if ctx > ref.context:
            raise ValueError(f"ctx {ctx} is longer than the reference's context ({ref.context})")
        ids = ref.tokenize(text, add_special=False)
        tok = ref.tokenizer
        self.chunks = _chunks(ids, ctx, tok.bos_id if tok.add_bos else None, max_chunks)
        if not self.chunks:
            raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; give a longer "
                             f"text or a smaller ctx")
        self.first = ctx // 2
        self.logprobs = [_log_softmax(np.asarray(ref.logits(c))[self.first:-1]).astype(np.float32)
                         for c in self.chunks]

    def kld(self, model) -> float:
        """Mean KL(reference || model) over the scored positions."""
        total, n = 0.0, 0
        for chunk, lr in zip(self.chunks, self.logprobs):
            lp = _log_softmax(np.asarray(model.logits(chunk))[self.first:-1])
            k = _kld_rows(lr.astype(np.float64), lp)
            total += float(k.sum())
            n += len(k)
        return total / n
