"""The Python face of the native engine: one object that loads a GGUF, tokenizes, applies
the chat template and drives the C++ request loop."""
from __future__ import annotations

import atexit
import collections
import math
import os
import secrets
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import numpy as np

from . import _core, kernel_tuning, native
from .chat_template import check_roles, render_chat
from .native import StepEvent
from .pull import path_error  # noqa: F401 - re-exported: one check of model/input paths
# The native engine's limits and the request spec (defaults and ranges of every parameter).
from .request import (DEFAULTS, MAX_CONTEXT, MAX_KV_TOKENS, MAX_TOP_LOGPROBS,  # noqa: F401 - MAX_*: re-exported
                      PARAMS, Sampling, check_sampling)
from .tokenizer import TextStream, Tokenizer, clean_text
# The argument checks every layer shares; ArgumentTypeError (a wrong type: a TypeError that is
# also a ValueError) is re-exported from here, where it has always been.
from .util import INT32_MAX as _INT32_MAX
from .util import ArgumentTypeError
from .util import check_bool as _check_bool
from .util import float_in as _float_in
from .util import int_in as _int_in
from .util import is_int as _is_int


def _piece_text(tokenizer, token: int) -> str:
    """A token's own text (its bytes as UTF-8; a token that is part of a character gives
    U+FFFD for the bytes it holds)."""
    if tokenizer is None:
        return ""
    try:
        return tokenizer.token_to_piece(token, True).decode("utf-8", "replace")
    except (ValueError, IndexError, KeyError):
        return ""


class TopLogprob(tuple):
    """One of the most likely tokens at a position: unpacks as the pair (token, logprob) and
    equals that tuple; `.text` is the token's text."""

    def __new__(cls, token: int, logprob: float, text: str = ""):
        self = super().__new__(cls, (token, logprob))
        self.text = text
        return self

    @property
    def token(self) -> int:
        return self[0]

    @property
    def logprob(self) -> float:
        return self[1]

    def __repr__(self) -> str:
        return f"TopLogprob(token={self[0]}, logprob={self[1]!r}, text={self.text!r})"

    def __reduce__(self):
        return (TopLogprob, (self[0], self[1], self.text))


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the model (log-softmax of the raw logits,
    before temperature and filters), its text, and the `top` most likely tokens at that
    position (most likely first; each unpacks as (token, logprob) and has `.text`)."""
    token: int
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)  # most likely first
    text: str = ""  # the token's own text (a token inside a UTF-8 character: U+FFFD)

    @classmethod
    def from_event(cls, ev: StepEvent, tokenizer=None) -> "TokenLogprob":
        """From a native step's event that carries log-probabilities; with `tokenizer`, the
        texts of the token and of the top entries are filled in."""
        return cls(ev.token, ev.logprob, [TopLogprob(t, v, _piece_text(tokenizer, t)) for t, v in ev.top or ()],
                   _piece_text(tokenizer, ev.token))


@dataclass
class Completion:
    """The result of Engine.generate/chat: the text, the generated token ids, why it ended
    ("stop": end of sequence or a stop string, "length": max_tokens reached), token counts
    (usage) and, when asked for, one TokenLogprob per generated token."""
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for


def resolve_model(model: str) -> str:
    """The path of a GGUF file: `model` itself when it is one, or the cached file of a model
    that tensorfold.pull() knows (downloaded on first use)."""
    from .pull import known_models, pull

    if not isinstance(model, (str, os.PathLike)) or isinstance(model, bytes):
        raise ArgumentTypeError(f"model must be a path or a known model name, not {type(model).__name__}")
    model = os.fspath(model)
    if not isinstance(model, str):
        raise ArgumentTypeError(f"model must be a path or a known model name, not {type(model).__name__}")
    err = path_error(model, "model")
    if err is not None:
        raise err
    if os.path.exists(model):
        if os.path.isdir(model):
            raise ValueError(f"{model} is a directory; give the path of a .gguf file")
        return model
    if model in known_models():
        return pull(model)
    raise FileNotFoundError(
        f"model {model!r} not found: give the path of a .gguf file or one of {sorted(known_models())}"
    )


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_memory_budget(v) -> int:
    """A memory budget as the native engine takes it: bytes (int, or text such as '120GiB',
    '512MB', '1.5T'); None or 'auto' = the memory available now (0); 'none' = no budget (-1)."""
    if v is None:
        return 0
    if _is_int(v):
        if v <= 0:
            raise ValueError(f"memory_budget must be positive bytes (or None / 'auto' / 'none'), got {v}")
        return int(v)
    if not isinstance(v, str):
        raise ArgumentTypeError(f"memory_budget must be bytes (an int), a size such as '120GiB', None, 'auto' or "
                                f"'none', not {type(v).__name__}")
    if isinstance(v, str):
        t = v.strip().lower().replace(" ", "")
        if t.startswith("-"):
            raise ValueError(f"memory_budget must be a positive size, got {v!r}")
        if t == "auto":
            return 0
        if t == "none":
            return -1
        num = t.rstrip("kmgtib")
        unit = t[len(num):]
        try:
            x = float(num)
        except ValueError:
            x = math.nan
        if unit in _UNITS and math.isfinite(x) and x > 0 and x * _UNITS[unit] < 2**62:
            return max(1, int(x * _UNITS[unit]))
    raise ValueError(f"memory_budget {v!r} is not a size: give bytes or e.g. '120GiB', '512MB' "
                     "(or 'auto' for the memory available now, 'none' for no budget)")


def resolve_transport(name: str) -> str:
    """'tcp', 'ibverbs', or 'auto' (ibverbs when this build has it and an RDMA device exists)."""
    if name == "auto":
        comm = _core.comm
        return "ibverbs" if comm.built_with_ibverbs() and comm.ibverbs_devices() else "tcp"
    if not isinstance(name, str):
        raise ArgumentTypeError(f"transport must be 'tcp', 'ibverbs' or 'auto', not {type(name).__name__}")
    if name not in ("tcp", "ibverbs"):
        raise ValueError(f"transport must be 'tcp', 'ibverbs' or 'auto', got {name!r}")
    return name


@dataclass
class _Request:
    """One generation as the Python side tracks it. Its native request may be parked
    (aborted, to be recomputed from prompt + generated tokens) while nobody reads it."""
    ids: list[int]
    sampling: Sampling  # checked, with its seed drawn when none was given
    eog_ids: list[int]
    parkable: bool  # resuming gives exactly the tokens it would have produced
    rid: int | None = None  # native id; None while not submitted, parked or finished
    events: collections.deque[StepEvent] = field(default_factory=collections.deque)
    generated: list[int] = field(default_factory=list)
    top_logprobs: int = -1  # -1: no logprobs; k >= 0: the token's and the k most likely
    park_at: int = 4  # unread events that get an idle stream parked (doubles each time)
    waiting: bool = False  # its reader is inside next() (stepping or waiting for the lock)
    done: bool = False  # finished, aborted or released


# Engines still open at interpreter exit are closed first: a daemon thread still inside a
# native step when Python finalizes would be killed while C++ frames are on its stack
# (std::terminate). Closing waits for the step and stops the stream cleanly.
_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    for eng in list(_live_engines):
        if not eng._following:  # a follower only returns when rank 0 stops; leave it be
            eng.close()


def context_warning(context: int, n_train: int, name: str) -> str | None:
    """The warning for a context longer than the model was trained for (None when it is
    not): what Engine warns at load and `tensorfold plan` prints."""
    if 0 < n_train < context:
        return (f"context {context} is longer than the {n_train} tokens {name} is made for (its "
                f"context_length, RoPE scaling included); output degrades past {n_train} tokens")
    return None


class Engine:
    """Loads a GGUF model onto the native engine.

    model: a .gguf path or a known model name (tensorfold.pull() fetches it). threads: worker
    threads (default: the CPUs this process may use: its affinity mask, capped by a cgroup CPU
    quota; more is allowed, with a warning). kv_tokens: size of the paged KV pool in tokens,
    in [1, 1073741824] (default: max(context, 4096)). context: per-sequence limit, in
    [2, 16777216] (default: the model's trained context, at most 8192). memory_budget: bytes
    or a size such as "120GiB" this engine may use (default: the memory available now;
    "none": no check); a plan over it raises MemoryError before anything is allocated.
    kv_type: "f16" (default, half the memory) or "f32" for
    the KV cache. Tensor parallel over two machines: tp=2 with rank=0 here and
    peer="HOST:PORT" where `tensorfold worker MODEL --tp 2 --rank 1 --listen HOST:PORT`
    runs (same model file and options); rails lists this machine's address on each link.
    token: shared secret of a TP pair (default: $TENSORFOLD_TP_TOKEN); when set, each rank
    admits only a peer that proves it knows the same token (the token never crosses the wire).
    tp_compatible=True (TP=1) computes exactly as a TP=2 pair does, so their outputs are
    bit-identical (about 5-10% slower decode).
    backend: where the forward pass runs: "cpu" (default: the best instruction set of this
    CPU), "cpu:avx512", "cpu:avx2", "cpu:scalar", "cuda" or "auto" (a GPU when one can run
    the model, else the CPU); tensorfold.available_backends() lists what this machine has.
    Engine.backend says which one was chosen.
    prefix_cache=True (default) keeps the KV blocks of finished requests and reuses them for
    prompts that start with the same tokens (a shared system prompt, the next chat turn):
    those tokens are not prefilled again, and the output is exactly the same as without it.
    Engine.stats() reports token counts, timings, prefix cache use ("prefix_cache_hits",
    "prefix_cached_tokens"), KV blocks ("kv_blocks_used", "kv_blocks_free", "kv_blocks_cached")
    and, for MoE models, the tokens routed to each expert of each layer ("expert_usage").

    close() (or leaving a `with Engine(...) as eng:` block) releases the native engine; later
    calls that need it raise RuntimeError. Streams that are not being read are parked after a
    few tokens (their KV cache freed, recomputed when read again) so they do not slow others.

    Arguments of the wrong type raise TypeError (ArgumentTypeError, which older code that
    catches ValueError also catches); of the right type but out of range, ValueError. Both
    messages name the valid range. The sampling parameters' defaults and ranges are the request
    spec's (tensorfold.request.PARAMS), the same the command line and the server use.
    """

    def __init__(self, model: str, *, threads: int | None = None, kv_tokens: int | None = None,
                 context: int | None = None, max_batch_tokens: int = 512, kv_type: str = "f16",
                 tp: int = 1, rank: int = 0, peer: str | None = None, rails: Sequence[str] | None = None,
                 timeout: float = 30.0, tp_compatible: bool = False, token: str | None = None,
                 memory_budget: int | str | None = None, transport: str = "tcp", wait: float = 0.0,
                 load_timeout: float = 3600.0, prefix_cache: bool = True, backend: str = "cpu",
                 max_seqs: int = 32, draft: str | None = None, draft_max: int = 8,
                 draft_adaptive: bool = True):
        self._core = None
        self._following = False
        self._closed = False
        self._owner = None  # a Scheduler (tensorfold.scheduler) that alone drives the native requests
        self._lock = threading.RLock()
        self._reqs: dict[int, _Request] = {}  # native id -> request
        self._to_abort: collections.deque[int] = collections.deque()  # released while the lock was busy
        # Types and ranges here; the native engine applies its own caps (with their reasons).
        for name, v, lo, hi in (("threads", threads, 1, _INT32_MAX), ("kv_tokens", kv_tokens, 1, MAX_KV_TOKENS),
                                ("context", context, 2, MAX_CONTEXT)):
            if v is not None:
                _int_in(name, v, lo, hi, note=" (None: automatic)")
        _int_in("max_batch_tokens", max_batch_tokens, 1)
        _int_in("max_seqs", max_seqs, 1, 1 << 16)
        _int_in("draft_max", draft_max, 1, 32)
        _check_bool("draft_adaptive", draft_adaptive)
        if draft is not None and not isinstance(draft, str):
            raise ArgumentTypeError(f"draft must be None, 'lookup' or a draft model path, not {type(draft).__name__}")
        if not isinstance(kv_type, str):
            raise ArgumentTypeError(f"kv_type must be 'f16' or 'f32', not {type(kv_type).__name__}")
        if kv_type not in ("f16", "f32"):
            raise ValueError(f"kv_type must be 'f16' or 'f32', got {kv_type!r}")
        _int_in("tp", tp, 1, 2)
        _int_in("rank", rank, 0, tp - 1)
        for name, v in (("peer", peer), ("token", token)):
            if v is not None and not isinstance(v, str):
                raise ArgumentTypeError(f"{name} must be a string or None, not {type(v).__name__}")
        if rails is not None:
            if isinstance(rails, (str, bytes)) or not all(isinstance(r, str) for r in rails):
                raise ArgumentTypeError("rails must be a list of addresses (strings), one per link")
            rails = list(rails)
        _check_bool("tp_compatible", tp_compatible)
        _float_in("timeout", timeout, 0.0, math.inf, lo_open=True, note=" seconds")
        budget = parse_memory_budget(memory_budget)
        transport = resolve_transport(transport)
        _float_in("wait", wait, 0.0, math.inf, note=" seconds (0: until rank 0 connects)")
        _float_in("load_timeout", load_timeout, 0.0, math.inf, lo_open=True, note=" seconds")
        _check_bool("prefix_cache", prefix_cache)
        if not isinstance(backend, str):
            raise ArgumentTypeError(f"backend must be a string such as 'cpu', not {type(backend).__name__}")
        self.path = resolve_model(model)
        self._gguf = _core.GgufFile(self.path)
        metadata = self._gguf.metadata()
        self.tokenizer = Tokenizer.from_gguf_metadata(metadata)
        self.chat_template: str | None = metadata.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ValueError(f"{self.path}: metadata tokenizer.chat_template is a "
                             f"{type(self.chat_template).__name__}, not a string")
        self._check_vocab(None)  # before loading the weights: fail fast
        draft = draft or ""
        if draft not in ("", "lookup", "mtp"):
            try:
                draft = resolve_model(draft)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"draft {draft!r}: {e}; draft must be 'lookup', 'mtp' or the path of a "
                                        "draft model GGUF") from None
        if tp == 2 and not peer:
            raise ValueError("tp=2 needs peer='HOST:PORT' (where rank 1 listens)")
        if backend == "cpu" or (backend == "auto" and not _core.cuda.device_count()):
            # The tuned CPU backend: the fastest kernel per (format, shape class), measured once.
            kernel_tuning.tune((t["type"] for t in self._gguf.tensors()), threads or _core.usable_cpus())
        self._core = _core.Engine(self.path, threads or 0, kv_tokens or 0, context or 0, max_batch_tokens,
                                  kv_type, tp, rank, peer or "", list(rails or []), float(timeout),
                                  bool(tp_compatible), token, budget, transport, float(wait),
                                  float(load_timeout), bool(prefix_cache), backend, max_seqs=max_seqs,
                                  draft=draft, draft_max=draft_max, draft_adaptive=draft_adaptive)
        self._config = dict(self._core.config)
        self._context = self._core.context
        self._threads = self._core.threads
        self._check_vocab(self._config["n_vocab"])
        long_context = context_warning(self._context, self._config.get("n_ctx_train") or 0,
                                       os.path.basename(self.path))
        if long_context:
            warnings.warn(long_context, RuntimeWarning, stacklevel=2)
        usable = _core.usable_cpus()
        if self._threads > usable:
            warnings.warn(
                f"threads={self._threads} is more than the {usable} CPUs this process may use (affinity "
                f"mask / cgroup CPU quota); it works, but is usually slower than threads={usable}",
                RuntimeWarning, stacklevel=2)
        _live_engines.add(self)

    @property
    def backend(self) -> str:
        """The backend the forward pass runs on, e.g. 'cpu:avx512'."""
        return self._native().backend

    @property
    def memory_plan(self) -> dict:
        """This rank's memory plan (bytes of weights, kv, scratch, comm, margin, total, budget,
        and the printable table), checked before anything was allocated."""
        return dict(self._native().memory_plan)

    def _check_vocab(self, n_vocab: int | None) -> None:
        """Like llama.cpp, the embedding and the output matrix must have exactly one row per
        token of the tokenizer (a mismatch fails mid-stream or reads past the table)."""
        n_tok = self.tokenizer.vocab_size
        sizes = {}
        if n_vocab is not None:
            sizes["embedding"] = n_vocab
        else:
            for name, what in (("token_embd.weight", "embedding"), ("output.weight", "output matrix")):
                try:
                    shape = self._gguf.tensor(name)["shape"]
                except (KeyError, ValueError, RuntimeError, IndexError, TypeError):
                    continue
                if len(shape) >= 2:
                    sizes[what] = int(shape[1])
        for what, n in sizes.items():
            if n != n_tok:
                raise ValueError(f"{self.path}: the tokenizer has {n_tok} tokens but the {what} has "
                                 f"{n} rows; they must match (the file is inconsistent)")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Release the native engine (under TP, tells the follower to stop). Waits for a step
        running in another thread; the streams still open then raise RuntimeError.
        Calling it again does nothing."""
        if getattr(self, "_core", None) is None:
            return
        self._closed = True  # other threads stop before their next step
        with self._lock:
            core, self._core = self._core, None
            for req in self._reqs.values():
                req.rid = None
            self._reqs.clear()
            self._to_abort.clear()
            self._gguf = None
        del core  # the native engine goes here, outside any step
        _live_engines.discard(self)

    @property
    def closed(self) -> bool:
        """True once close() was called (or the engine never finished loading)."""
        return getattr(self, "_core", None) is None

    def __enter__(self) -> "Engine":
        """`with Engine(...) as eng:` closes the engine when the block ends."""
        return self

    def __exit__(self, *exc) -> None:
        """Closes the engine (see close())."""
        self.close()

    def _native(self):
        core = self._core
        if core is None or self._closed:
            raise RuntimeError("the engine is closed")
        # One fstat: a model file truncated or rewritten under the mapping is reported here
        # instead of killing the process with SIGBUS at the next weight read.
        self._gguf.check_unchanged()
        return core

    # -- properties -----------------------------------------------------------------------

    @property
    def config(self) -> dict:
        """The model's configuration as the native engine read it: architecture, layer and
        head counts, vocabulary size ("n_vocab"), trained context ("n_ctx_train"), a one-line
        "summary", ..."""
        return self._config

    @property
    def context(self) -> int:
        """The per-sequence context in tokens: a prompt and its completion together fit in it."""
        return self._context

    @property
    def threads(self) -> int:
        """The number of worker threads the native engine runs."""
        return self._threads

    def stats(self) -> dict:
        """Counters since load: "prompt_tokens" and "generated_tokens" with "prefill_seconds"
        and "decode_seconds", "active_requests", the KV pool ("kv_tokens", "free_kv_tokens",
        "kv_blocks_used/free/cached"), the prefix cache ("prefix_cache_hits",
        "prefix_cached_tokens"), "expert_usage" for MoE models, and "comm" under TP."""
        with self._lock:
            core = self._native()
            self._drain_aborts(core)
            st = core.stats()
            if core.tp_size > 1:
                st["comm"] = core.comm_stats()
        return st

    def follow(self) -> None:
        """TP rank 1: serve rank 0's forwards until it shuts down."""
        with self._lock:
            core = self._native()
            self._following = True
            try:
                core.follow()
            finally:
                self._following = False

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """The token ids of `text`; add_special=True adds BOS (and EOS) as the model's
        tokenizer metadata asks."""
        if not isinstance(text, str):
            raise ArgumentTypeError(f"text must be str, not {type(text).__name__}")
        return self.tokenizer.encode(text, add_special=_check_bool("add_special", add_special))

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ids (bytes that are not valid UTF-8 become U+FFFD)."""
        return self.tokenizer.decode(self._token_ids(ids, "ids", check_vocab=False))

    def logits(self, ids: Sequence[int], *, generated_from: int | None = None) -> np.ndarray:
        """float32 logits for every position of `ids`: shape [len(ids), vocab]. `generated_from`:
        the position from which `ids` are tokens this engine generated (prompt + output): they are
        computed as decoding computes them (prompts may take faster batch kernels whose rounding
        differs), so the result equals the generation's own logits bit for bit."""
        ids = self._token_ids(ids, "ids")
        if generated_from is not None:
            generated_from = _int_in("generated_from", generated_from, 0, len(ids))
        with self._lock:
            native = self._native()
            if generated_from is None:
                return native.logits(ids)  # the native array, not copied here
            return native.logits(ids, generated_from)

    def routing(self, ids: Sequence[int]) -> list[list[int]]:
        """Experts chosen by each MoE layer for every position of `ids`:
        [n_layer][len(ids) * top_k] (empty lists for dense layers)."""
        ids = self._token_ids(ids, "ids")
        with self._lock:
            return self._native().routing(ids)

    def _token_ids(self, ids, what: str = "prompt", check_vocab: bool = True) -> list[int]:
        """`ids` as a list of Python ints. Bytes are refused (they would read as one id per
        byte), and so are floats and bools (1.5 or True would silently become id 1)."""
        if isinstance(ids, (str, bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"{what} must be a sequence of integer token ids, not {type(ids).__name__}"
                            + ("; decode bytes to text first (e.g. data.decode('utf-8', 'replace'))"
                               if not isinstance(ids, str) else ""))
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ArgumentTypeError(f"{what}: a numpy array of token ids must be 1-D with an integer dtype, "
                                f"got {ids.ndim}-D {ids.dtype}")
            out = ids.tolist()
        else:
            try:
                items = list(ids)
            except TypeError:
                raise ArgumentTypeError(f"{what} must be text or a sequence of integer token ids, "
                                f"not {type(ids).__name__}") from None
            out = []
            for i in items:
                if not _is_int(i):
                    raise ArgumentTypeError(f"{what}: token ids must be integers, got {i!r} ({type(i).__name__})")
                out.append(int(i))
        if check_vocab:
            vocab = self._config["n_vocab"]
            for i in out:
                if not 0 <= i < vocab:
                    raise ValueError(f"token id {i} is outside the vocabulary (0..{vocab - 1})")
        return out

    # -- generation -----------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template (ChatML when it has none) makes of
        `messages` ([{"role": ..., "content": ...}, ...]; roles as check_roles() accepts), with
        the assistant's turn opened when add_generation_prompt."""
        _check_messages(messages)
        messages = check_roles(messages)
        _check_bool("add_generation_prompt", add_generation_prompt)
        tok = self.tokenizer
        bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.id_to_token(tok.eos_id) if tok.eos_id is not None else ""
        return clean_text(render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                      bos_token=bos, eos_token=eos))

    def _prompt_ids(self, prompt: str | Sequence[int] | None, messages: list[dict] | None) -> list[int]:
        if messages is not None:
            if prompt is not None:
                raise ValueError("give either prompt or messages, not both")
            _check_messages(messages)
            messages = check_roles(messages)
            messages, literals = self._mark_special_text(messages)
            text = self.apply_chat_template(messages)
            # The template writes any BOS itself; the control tokens it writes are parsed as
            # such, while those a message's content quotes are text (see _mark_special_text).
            return self.tokenizer.encode_with_literals(text, literals)
        if prompt is None:
            raise ValueError("a prompt (text or token ids) is required")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        return self._token_ids(prompt)

    def _mark_special_text(self, messages):
        """Messages whose string contents have every control-token string (``<|im_end|>``, ...)
        replaced by a marker, and the markers' texts: the rendered chat is then tokenized with
        those strings as text, so a user cannot close their turn or forge another role's. The
        markers carry a random nonce, so content cannot forge one either. Messages without
        such strings (nearly all) are passed through unchanged."""
        special = self.tokenizer.special_text_re
        if special is None or not isinstance(messages, (list, tuple)):
            return messages, {}
        literals: dict[str, str] = {}
        nonce = None
        out = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str) and special.search(content):
                if nonce is None:
                    nonce = "".join(chr(0xF0000 + b) for b in secrets.token_bytes(6))

                def mark(match):
                    key = f"\U000FFFF0{nonce}{len(literals)}\U000FFFF1"
                    literals[key] = match.group()
                    return key

                m = dict(m, content=special.sub(mark, content))
            out.append(m)
        return out, literals

    def _request(self, ids: list[int], **sampling) -> _Request:
        """Checks the sampling parameters (request.PARAMS: types and ranges, NaN and inf
        included; those not given take their defaults) into a request."""
        s = check_sampling(**sampling)
        parkable = s.greedy or s.seed is None  # an explicit seed must give the same tokens however read
        seed = secrets.randbits(63) if s.seed is None else s.seed & (2**64 - 1)
        return _Request(ids=ids, sampling=s._replace(seed=seed), eog_ids=sorted(self.tokenizer.eog_ids),
                        parkable=parkable)

    @staticmethod
    def _stops(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        try:
            stops = list(stop)
        except TypeError:
            raise ArgumentTypeError(f"stop must be a string or a list of strings, not {type(stop).__name__}") from None
        for s in stops:
            if not isinstance(s, str):
                raise ArgumentTypeError(f"stop strings must be str, got {s!r}")
        return [s for s in stops if s]

    def _run(self, req: _Request, stops: list[str]) -> Iterator[tuple[str, int | None, str | None, StepEvent]]:
        """Yields (text_piece, token_id, finish_reason, event) as tokens arrive; the last
        item has the finish reason. Stop strings are matched on the text and never emitted."""
        text = TextStream(self.tokenizer, stops)
        reason = None
        try:
            while reason is None:
                ev = self._next_event(req)
                emit, reason = text.feed(ev.token, ev.finished, ev.reason)
                yield emit, (ev.token if ev.token >= 0 else None), reason, ev
        finally:
            self._release(req)

    def _release(self, req: _Request) -> None:
        """Ends `req`'s native request (finished, closed or garbage-collected generator).
        Never blocks: when another thread holds the lock (a finalizer may run anywhere), the
        abort is queued and done before the next step."""
        req.done = True
        rid, req.rid = req.rid, None
        if rid is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                self._reqs.pop(rid, None)
                if self._core is not None:
                    self._core.abort(rid)  # no-op when it already finished
            finally:
                self._lock.release()
        else:
            self._to_abort.append(rid)

    def _drain_aborts(self, core) -> None:
        while self._to_abort:
            rid = self._to_abort.popleft()
            self._reqs.pop(rid, None)
            core.abort(rid)

    def _park_idle(self, core, reader: _Request) -> None:
        """Aborts the native requests of streams nobody is reading that have buffered enough
        unread tokens; they are recomputed (exactly: see _Request.parkable) when read again."""
        for rid, r in list(self._reqs.items()):
            if r is not reader and r.parkable and not r.waiting and len(r.events) >= r.park_at:
                core.abort(rid)
                self._reqs.pop(rid, None)
                r.rid = None
                r.park_at = min(2 * r.park_at, 256)  # a slow reader is parked less and less often

    def _next_event(self, req: _Request) -> StepEvent:
        """The next event of `req`, stepping the engine (native.step) as needed. Events of
        other requests (interleaved streams) are queued for them."""
        if self._owner is not None:
            raise RuntimeError("this engine is driven by a tensorfold.scheduler.Scheduler (e.g. tensorfold "
                               "serve); submit requests through the scheduler, or close it first")
        req.waiting = True
        try:
            with self._lock:
                while not req.events:
                    core = self._native()
                    self._drain_aborts(core)
                    if req.rid is None:
                        if req.done:
                            return StepEvent(-1, -1, True, "abort")
                        # first read, or parked: (re)submit prompt + the tokens produced so far
                        rid = native.add_request(core, req.ids + req.generated, req.sampling,
                                                 max_tokens=req.sampling.max_tokens - len(req.generated),
                                                 eog_ids=req.eog_ids, top_logprobs=req.top_logprobs,
                                                 resumed=len(req.generated))
                        req.rid = rid
                        self._reqs[rid] = req
                    self._park_idle(core, req)
                    events = native.step(core)
                    if not events and not core.has_unfinished():
                        return StepEvent(-1, -1, True, "abort")
                    for ev in events:
                        r = self._reqs.get(ev.request_id)
                        if r is None:
                            continue
                        r.events.append(ev)
                        if ev.token >= 0:
                            r.generated.append(ev.token)
                        if ev.finished:
                            self._reqs.pop(ev.request_id, None)
                            r.rid = None
                            r.done = True
                return req.events.popleft()
        finally:
            req.waiting = False

    def generate(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
                 max_tokens: int = DEFAULTS["max_tokens"], temperature: float = DEFAULTS["temperature"],
                 top_k: int = DEFAULTS["top_k"], top_p: float = DEFAULTS["top_p"], min_p: float = DEFAULTS["min_p"],
                 presence_penalty: float = DEFAULTS["presence_penalty"],
                 frequency_penalty: float = DEFAULTS["frequency_penalty"],
                 seed: int | None = DEFAULTS["seed"], stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = DEFAULTS["ignore_eos"], logprobs: int | None = DEFAULTS["logprobs"]) -> Completion:
        """Completes `prompt` (text, which gets BOS as the model asks, or token ids used
        verbatim), or with messages=[{"role": ..., "content": ...}, ...] the assistant's turn
        of a conversation (roles: system, user, assistant, tool, developer). Generates at most
        max_tokens tokens, sampled with temperature (0 = greedy), top_k (0 = off), top_p
        (1 = off) and min_p (0 = off), after OpenAI's presence_penalty / frequency_penalty over
        the tokens generated so far (0 = off); seed makes sampling reproducible; generation ends at the
        first of `stop` (never included in the text) or end of sequence unless ignore_eos.
        logprobs=k (0..20) also returns each generated token's log-probability and the k most
        likely tokens at its position (Completion.logprobs, with their texts). Returns a
        Completion. The defaults and ranges are tensorfold.request.PARAMS's."""
        self._native()
        logprobs = PARAMS["logprobs"].check(logprobs)
        ids = self._prompt_ids(prompt, messages)
        req = self._request(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos)
        req.top_logprobs = -1 if logprobs is None else logprobs
        text, tokens, lps, reason = [], [], [], "length"
        for piece, token, why, ev in self._run(req, self._stops(stop)):
            text.append(piece)
            if token is not None:
                tokens.append(token)
                if ev.logprob is not None:
                    lps.append(TokenLogprob.from_event(ev, self.tokenizer))
            if why:
                reason = why
        return Completion(text="".join(text), token_ids=tokens, finish_reason=reason,
                          usage={"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                                 "total_tokens": len(ids) + len(tokens)},
                          logprobs=lps if logprobs is not None else None)

    def stream(self, prompt: str | Sequence[int] | None = None, *, messages: list[dict] | None = None,
               max_tokens: int = DEFAULTS["max_tokens"], temperature: float = DEFAULTS["temperature"],
               top_k: int = DEFAULTS["top_k"], top_p: float = DEFAULTS["top_p"], min_p: float = DEFAULTS["min_p"],
               presence_penalty: float = DEFAULTS["presence_penalty"],
               frequency_penalty: float = DEFAULTS["frequency_penalty"],
               seed: int | None = DEFAULTS["seed"], stop: str | Sequence[str] | None = None,
               ignore_eos: bool = DEFAULTS["ignore_eos"]) -> Iterator[str]:
        """Like generate(), but yields the text pieces as they are generated (never a split
        UTF-8 character). Arguments are checked here; the request starts with the first read.
        The returned Stream's finish_reason says why it ended ("stop" or "length") once it
        has; close() it to stop early."""
        self._native()
        ids = self._prompt_ids(prompt, messages)
        req = self._request(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos)
        return Stream(self._run(req, self._stops(stop)))

    def chat(self, messages: list[dict], **kwargs) -> Completion:
        """Applies the model's chat template to `messages` and completes the assistant turn
        (the keyword arguments are generate()'s)."""
        return self.generate(messages=messages, **kwargs)


class Stream(Iterator[str]):
    """The text pieces of one generation (Engine.stream). `finish_reason` is None while it
    runs, then "stop" (end of sequence or a stop string), "length" (max_tokens) or "abort".
    close() ends it early and frees its KV cache."""

    def __init__(self, events: Iterator):
        self._events = events  # Engine._run: (piece, token, finish_reason, event)
        self.finish_reason: str | None = None

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        while True:
            piece, _, why, _ = next(self._events)
            if why:
                self.finish_reason = why
            if piece:
                return piece

    def close(self) -> None:
        """Stops the generation (its native request is released)."""
        self._events.close()


def _check_messages(messages) -> None:
    """`messages` must be a list (or tuple) of dicts: a wrong type is a TypeError; what is
    inside (roles, content) is checked as its value (ValueError)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ArgumentTypeError(f"messages must be a list of dicts such as {{'role': 'user', 'content': '...'}}, "
                                f"not {type(messages).__name__}")
