"""The Python face of the native engine: one object that loads a GGUF, tokenizes, applies
the chat template and drives the C++ request loop."""
from __future__ import annotations

import collections
import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import _core
from .chat_template import render_chat
from .tokenizer import StreamDecoder, Tokenizer


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict = field(default_factory=dict)


def resolve_model(model: str) -> str:
    """A GGUF path, or the name of a model that tensorfold.pull() knows."""
    from .pull import known_models, pull

    if os.path.exists(model):
        if os.path.isdir(model):
            raise ValueError(f"{model} is a directory; give the path of a .gguf file")
        return model
    if model in known_models():
        return pull(model)
    raise FileNotFoundError(
        f"model {model!r} not found: give the path of a .gguf file or one of {sorted(known_models())}"
    )


class Engine:
    """Loads a GGUF model onto the native engine.

    threads: worker threads (default: all cores). kv_tokens: size of the paged KV pool in
    tokens (default: max(context, 4096)). context: per-sequence limit (default: the model's
    trained context, at most 8192). kv_type: "f16" (default, half the memory) or "f32" for
    the KV cache. Tensor parallel over two machines: tp=2 with rank=0 here and
    peer="HOST:PORT" where `tensorfold worker MODEL --tp 2 --rank 1 --listen HOST:PORT`
    runs (same model file and options); rails lists this machine's address on each link.
    tp_compatible=True (TP=1) computes exactly as a TP=2 pair does, so their outputs are
    bit-identical (about 5-10% slower decode).
    Engine.stats() reports token counts, timings and, for MoE models, the
    tokens routed to each expert of each layer ("expert_usage").
    """

    def __init__(self, model: str, *, threads: int | None = None, kv_tokens: int | None = None,
                 context: int | None = None, max_batch_tokens: int = 512, kv_type: str = "f16",
                 tp: int = 1, rank: int = 0, peer: str | None = None, rails: Sequence[str] | None = None,
                 timeout: float = 30.0, tp_compatible: bool = False):
        for name, v in (("threads", threads), ("kv_tokens", kv_tokens), ("context", context)):
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.path = resolve_model(model)
        self._gguf = _core.GgufFile(self.path)
        metadata = self._gguf.metadata()
        self.tokenizer = Tokenizer.from_gguf_metadata(metadata)
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        if tp not in (1, 2):
            raise ValueError(f"tp must be 1 or 2, got {tp}")
        if tp == 2 and not peer:
            raise ValueError("tp=2 needs peer='HOST:PORT' (where rank 1 listens)")
        self._core = _core.Engine(self.path, threads or 0, kv_tokens or 0, context or 0, max_batch_tokens,
                                  kv_type, tp, rank, peer or "", list(rails or []), float(timeout),
                                  bool(tp_compatible))
        if self._core.config["n_vocab"] < self.tokenizer.vocab_size:
            raise ValueError(
                f"{self.path}: the tokenizer has {self.tokenizer.vocab_size} tokens but the "
                f"embedding only {self._core.config['n_vocab']}"
            )
        self._lock = threading.RLock()
        self._queues: dict[int, collections.deque] = {}

    # -- properties -----------------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self._core.config

    @property
    def context(self) -> int:
        return self._core.context

    @property
    def threads(self) -> int:
        return self._core.threads

    def stats(self) -> dict:
        st = self._core.stats()
        if self._core.tp_size > 1:
            st["comm"] = self._core.comm_stats()
        return st

    def follow(self) -> None:
        """TP rank 1: serve rank 0's forwards until it shuts down."""
        self._core.follow()

    def close(self) -> None:
        """Release the native engine (under TP, tells the follower to stop)."""
        self._core = None

    # -- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids: list[int]) -> np.ndarray:
        """float32 logits for every position of `ids`: shape [len(ids), vocab]."""
        with self._lock:
            return self._core.logits([int(i) for i in ids])

    def routing(self, ids: list[int]) -> list[list[int]]:
        """Experts chosen by each MoE layer for every position of `ids`:
        [n_layer][len(ids) * top_k] (empty lists for dense layers)."""
        with self._lock:
            return self._core.routing([int(i) for i in ids])

    # -- generation -----------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        tok = self.tokenizer
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos)

    def _prompt_ids(self, prompt: str | Sequence[int] | None, messages: list[dict] | None) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            text = self.apply_chat_template(messages)
            # The template writes any BOS itself; special tokens in it are parsed as such.
            return self.tokenizer.encode(text, add_special=False)
        if prompt is None:
            raise ValueError("a prompt (text or token ids) is required")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        ids = [int(i) for i in prompt]
        vocab = self.config["n_vocab"]
        for i in ids:
            if not 0 <= i < vocab:
                raise ValueError(f"token id {i} is outside the vocabulary (0..{vocab - 1})")
        return ids

    def _run(self, ids: list[int], *, max_tokens: int, temperature: float, top_k: int, top_p: float,
             min_p: float, seed: int | None, stop: str | Sequence[str] | None,
             ignore_eos: bool) -> Iterator[tuple[str, int | None, str | None]]:
        """Yields (text_piece, token_id, finish_reason) as tokens arrive; the last item has
        the finish reason. Stop strings are matched on the text and never emitted."""
        if isinstance(stop, str):
            stop = [stop]
        stops = [s for s in (stop or []) if s]
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if seed is None:
            seed = secrets.randbits(63)
        hold = max((len(s) for s in stops), default=1) - 1
        decoder = StreamDecoder(self.tokenizer)
        eog = self.tokenizer.eog_ids
        with self._lock:
            rid = self._core.add_request(ids, max_tokens, float(temperature), int(top_k), float(top_p),
                                         float(min_p), int(seed) & (2**64 - 1), sorted(eog),
                                         bool(ignore_eos))
            self._queues[rid] = collections.deque()
        pending = ""
        reason = None
        try:
            while reason is None:
                _, token, finished, why = self._next_event(rid)
                if token >= 0 and not (finished and why == "stop" and token in eog):
                    pending += decoder.feed(token)
                if finished:
                    reason = why
                    pending += decoder.flush()
                if stops:
                    cut = min((pending.find(s) for s in stops if s in pending), default=-1)
                    if cut >= 0:
                        pending = pending[:cut]
                        reason = "stop"
                emit = pending if reason else pending[: max(0, len(pending) - hold)]
                pending = pending[len(emit):]
                yield emit, (token if token >= 0 else None), reason
        finally:
            with self._lock:
                self._core.abort(rid)  # no-op when it already finished
                self._queues.pop(rid, None)

    def _next_event(self, rid: int) -> tuple:
        """Next event of request `rid`, stepping the engine as needed. Events of other
        requests (interleaved streams) are queued for them."""
        with self._lock:
            q = self._queues[rid]
            while not q:
                events = self._core.step()
                if not events and not self._core.has_unfinished():
                    return (rid, -1, True, "abort")
                for ev in events:
                    if ev[0] in self._queues:
                        self._queues[ev[0]].append(ev)
            return q.popleft()

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
                 max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
                 min_p: float = 0.05, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False) -> Completion:
        """Complete `prompt` (text, or token ids used verbatim). temperature=0 is greedy."""
        ids = self._prompt_ids(prompt, messages)
        text, tokens, reason = [], [], "length"
        for piece, token, why in self._run(ids, max_tokens=max_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                           stop=stop, ignore_eos=ignore_eos):
            text.append(piece)
            if token is not None:
                tokens.append(token)
            if why:
                reason = why
        return Completion(text="".join(text), token_ids=tokens, finish_reason=reason,
                          usage={"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                                 "total_tokens": len(ids) + len(tokens)})

    def stream(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
               max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95,
               min_p: float = 0.05, seed: int | None = None, stop: str | Sequence[str] | None = None,
               ignore_eos: bool = False) -> Iterator[str]:
        """Yields text pieces as they are generated (never a split UTF-8 character)."""
        ids = self._prompt_ids(prompt, messages)
        for piece, _, _ in self._run(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, min_p=min_p, seed=seed, stop=stop,
                                     ignore_eos=ignore_eos):
            if piece:
                yield piece

    def chat(self, messages: list[dict], **kwargs) -> Completion:
        """Applies the model's chat template to `messages` and completes the assistant turn."""
        return self.generate(messages=messages, **kwargs)
