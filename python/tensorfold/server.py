"""`tensorfold serve`: an OpenAI-compatible HTTP API over one Engine.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}] (these
need the API key when one is set), GET /health (the process is up), GET /ready (the model
is loaded), GET /metrics (Prometheus). Requests go to one Scheduler thread that owns the
native engine (tensorfold.scheduler); results come back to the asyncio handlers through
loop.call_soon_threadsafe. A client that goes away (its connection closes) has its request
aborted in the engine, which frees its KV cache.

Request bodies are checked against the request spec (tensorfold.request): the ranges every
layer shares, and for a sampling parameter a client leaves out, the OpenAI API's value
(temperature 1, top_p 1, top_k and min_p off) rather than the Python API's llama.cpp-like
defaults, since that is what an OpenAI client means by leaving it out.

This module needs FastAPI, pydantic 2, uvicorn and prometheus-client (`pip install 'tensorfold[serve]'`);
`import tensorfold` does not import it.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import signal
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .chat_template import check_role
from .request import HTTP_LEGACY_MAX_TOKENS, ParamError, check_top_logprobs, openai_model, parse_openai
from .scheduler import Delta, EngineFailed, Observer, QueueFull, Scheduler, SchedulerClosed, asyncio_sink
from .util import is_int as _is_int
from .util import is_number as _is_num

if int(pydantic.VERSION.split(".")[0]) < 2:  # FastAPI still runs on pydantic 1; the request models need 2
    raise ImportError(f"pydantic>=2 is needed, found {pydantic.VERSION}")

log = logging.getLogger("tensorfold.server")

KV_BLOCK_SIZE = 16  # tokens per KV block of the native pool (when stats() does not say)
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
FINGERPRINT = f"tensorfold-{__version__}"


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/* when set
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413
    max_prompt_tokens: int | None = None  # None: the context minus one
    max_running: int = 32  # requests in the engine at once
    max_queue: int = 64  # waiting requests beyond which new ones get 429
    body_timeout: float | None = None  # longest pause (s) while a request body arrives; then 408


class ApiError(Exception):
    """An error answered in OpenAI's schema: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return _json(self.body(), self.status, self.headers)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json(obj: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(_dumps(obj), status_code=status, media_type="application/json", headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _internal(e: BaseException) -> ApiError:
    return ApiError(500, f"the engine failed: {type(e).__name__}: {e}", None, "internal_error")


# -- metrics -----------------------------------------------------------------------------
class Metrics(Observer):
    """Prometheus metrics of one app (its own registry): request and token counters, latency
    histograms (observed on the scheduler thread), and at scrape time the engine's state."""

    ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/metrics")

    def __init__(self, state: "_State"):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("tensorfold_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.requests = Counter("tensorfold_requests", "Generation requests ended, by finish reason "
                                "(stop, length, abort = client went away, error)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tensorfold_prompt_tokens", "Prompt tokens of the requests submitted",
                                     registry=r)
        self.generation_tokens = Counter("tensorfold_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tensorfold_time_to_first_token_seconds",
                              "Seconds from a request's arrival at the scheduler to its first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.itl = Histogram("tensorfold_inter_token_latency_seconds", "Seconds between consecutive tokens of a request",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.e2e = Histogram("tensorfold_request_duration_seconds", "Seconds from arrival to the last token",
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600), registry=r)
        r.register(_EngineCollector(state))

    def endpoint(self, path: str) -> str:
        if path.startswith("/v1/models"):
            return "/v1/models"
        return path if path in self.ENDPOINTS else "other"

    # Observer (scheduler thread)
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, req) -> None:
        reason = "error" if req.error is not None else (req.finish_reason or "error")
        self.requests.labels(reason).inc()
        self.generation_tokens.inc(req.n_generated)
        if req.t_last is not None:
            self.e2e.observe(req.t_last - req.t_submit)


class _EngineCollector:
    """Reads the engine's state at scrape time (waits for the step in progress)."""

    def __init__(self, state: "_State"):
        self.state = state

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.state
        yield GaugeMetricFamily("tensorfold_model_ready", "1 when the model is loaded and serving",
                                value=1 if st.sched is not None and not st.sched.closed else 0)
        sched = st.sched
        if sched is None or sched.closed:
            return
        try:
            s = sched.stats()
        except Exception:  # the engine is closing: report what is known
            return
        bs = int(s.get("kv_block_size", KV_BLOCK_SIZE)) or KV_BLOCK_SIZE
        kv_total, kv_free = int(s["kv_tokens"]), int(s["free_kv_tokens"])
        gauges = (
            ("tensorfold_queue_depth", "Requests waiting to enter the engine", s["queue_depth"]),
            ("tensorfold_running_requests", "Requests in the engine (scheduled by the server)", s["running_requests"]),
            ("tensorfold_engine_active_sequences", "Sequences the native engine holds", s["active_requests"]),
            ("tensorfold_kv_blocks_total", f"KV cache blocks ({bs} tokens each)", kv_total // bs),
            ("tensorfold_kv_blocks_free", "Free KV cache blocks", kv_free // bs),
            ("tensorfold_kv_blocks_used", "KV cache blocks in use", (kv_total - kv_free) // bs),
            ("tensorfold_kv_tokens_total", "KV cache capacity in tokens", kv_total),
            ("tensorfold_kv_tokens_free", "Free KV cache tokens", kv_free),
        )
        for name, doc, v in gauges:
            yield GaugeMetricFamily(name, doc, value=v)
        counters = (
            ("tensorfold_prefix_cache_hits", "Prompt tokens served from the prefix cache",
             s.get("prefix_cache_hits", 0)),
            ("tensorfold_engine_steps", "Engine steps", s.get("steps", 0)),
            ("tensorfold_engine_preemptions", "Sequences preempted (KV freed, recomputed later)",
             s.get("preemptions", 0)),
            ("tensorfold_engine_prompt_tokens", "Prompt tokens the engine computed", s.get("prompt_tokens", 0)),
            ("tensorfold_engine_generated_tokens", "Tokens the engine generated", s.get("generated_tokens", 0)),
            ("tensorfold_engine_decode_seconds", "Seconds of engine steps that only decoded",
             s.get("decode_seconds", 0.0)),
            ("tensorfold_engine_prefill_seconds", "Seconds of engine steps that prefilled (with or without decode)",
             s.get("prefill_seconds", 0.0)),
            ("tensorfold_spec_verifies", "Speculative decoding: a sequence's drafts verified in a step",
             s.get("spec_verifies", 0)),
            ("tensorfold_spec_draft_tokens", "Speculative decoding: tokens drafted", s.get("spec_drafted", 0)),
            ("tensorfold_spec_accepted_tokens", "Speculative decoding: drafted tokens accepted",
             s.get("spec_accepted", 0)),
            ("tensorfold_spec_draft_seconds", "Speculative decoding: seconds spent drafting",
             s.get("draft_seconds", 0.0)),
        )
        for name, doc, v in counters:
            yield CounterMetricFamily(name, doc, value=v)


# -- app state ---------------------------------------------------------------------------
class _State:
    def __init__(self, config: ServerConfig, engine=None, loader: Callable[[], Any] | None = None,
                 on_load_error: Callable[[BaseException], None] | None = None,
                 on_engine_failure: Callable[[BaseException], None] | None = None):
        self.config = config
        self.engine = engine
        self.own_engine = engine is None
        self.loader = loader
        self.on_load_error = on_load_error
        self.on_engine_failure = on_engine_failure
        self.sched: Scheduler | None = None
        self.load_error: BaseException | None = None
        self.engine_error: BaseException | None = None  # the scheduler stopped on it: nothing is served
        self.load_thread: threading.Thread | None = None
        self.stopping = False
        self.created = int(time.time())
        self.lock = threading.Lock()
        self.metrics = Metrics(self)

    def start(self) -> None:
        with self.lock:
            if self.stopping:
                return
            self.sched = Scheduler(self.engine, max_running=self.config.max_running,
                                   max_queue=self.config.max_queue, observer=self.metrics,
                                   on_failure=self._engine_failed)

    def _engine_failed(self, e: BaseException) -> None:
        """The scheduler stopped on an engine that cannot go on (scheduler thread): every request
        it held has its error already; from now on /health and /ready say so."""
        self.engine_error = e
        log.error("the engine failed; nothing more can be served: %s", e)
        if self.on_engine_failure is not None:
            self.on_engine_failure(e)

    def load(self) -> None:
        try:
            eng = self.loader()
        except BaseException as e:
            self.load_error = e
            if self.on_load_error:
                self.on_load_error(e)
            else:
                log.error("loading the model failed: %s", e)
            return
        with self.lock:
            late = self.stopping
            self.engine = eng
        if late:
            eng.close()
            return
        self.start()

    def shutdown(self) -> None:
        with self.lock:
            self.stopping = True
            sched = self.sched
        if sched is not None:
            sched.close()
        if self.own_engine and self.engine is not None:
            self.engine.close()

    def ready_scheduler(self) -> Scheduler:
        sched = self.sched
        if sched is None or sched.closed:
            if self.engine_error is not None:
                raise ApiError(503, f"the engine failed and this server cannot serve any more: {self.engine_error}",
                               code="engine_failed")
            if self.load_error is not None:
                raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            if self.stopping or sched is not None:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            raise ApiError(503, "the model is still loading; try again shortly (see /ready)", code="model_loading",
                           headers={"Retry-After": "2"})
        return sched

    @property
    def max_prompt_tokens(self) -> int:
        ctx = self.engine.context
        lim = self.config.max_prompt_tokens
        return ctx - 1 if lim is None else max(1, min(lim, ctx - 1))


# -- the guard: API key, body size, HTTP metrics -----------------------------------------
async def _send_error(send, err: ApiError) -> None:
    body = _dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Guard:
    """Outermost ASGI layer: checks the API key on /v1/* (before reading any body), refuses
    bodies over the limit with 413 (by Content-Length, or while reading a chunked one), and
    counts responses by endpoint and status. The body it read is replayed to the app; later
    receive() calls go to the server, so a client disconnect is still seen by the handlers."""

    def __init__(self, app, state: _State):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_counted(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            err = self._check(scope)
            if err is not None:
                return await _send_error(send_counted, err)
            limit = self.state.config.max_body_bytes
            timeout = self.state.config.body_timeout
            chunks, size = [], 0
            while True:
                try:
                    msg = await asyncio.wait_for(receive(), timeout)
                except asyncio.TimeoutError:
                    return await _send_error(send_counted, ApiError(
                        408, f"the request body stopped arriving for {timeout:g} s (--header-timeout)",
                        code="request_timeout", headers={"Connection": "close"}))
                if msg["type"] == "http.disconnect":
                    status[0] = 499
                    return
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await _send_error(send_counted, ApiError(
                        413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                        code="request_too_large"))
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
            body, replayed = b"".join(chunks), False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send_counted)
        finally:
            self.state.metrics.http_requests.labels(self.state.metrics.endpoint(scope["path"]), str(status[0])).inc()

    def _check(self, scope) -> ApiError | None:
        path = scope["path"]
        headers = scope["headers"]
        key = self.state.config.api_key
        if key and (path == "/v1" or path.startswith("/v1/")):
            given = b""
            for k, v in headers:
                if k == b"authorization":
                    given = v
                    break
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), key.encode()):
                return ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        for k, v in headers:
            if k == b"content-length":
                try:
                    n = int(v)
                    if n < 0:
                        raise ValueError
                except ValueError:
                    return ApiError(400, "invalid Content-Length header", code="invalid_request")
                if n > self.state.config.max_body_bytes:
                    return ApiError(413, f"the request body ({n} bytes) is larger than "
                                         f"{self.state.config.max_body_bytes} bytes (--max-body-bytes)",
                                    code="request_too_large")
        return None


# -- request parsing ---------------------------------------------------------------------
# The sampling fields (temperature, top_p, top_k, min_p, seed, ignore_eos, max_tokens /
# max_completion_tokens) are checked by the request spec's Pydantic model (request.parse_openai:
# the ranges and the defaults an OpenAI client expects when it leaves one out); the OpenAI
# fields around them that TensorFold takes only in their neutral form are checked here.
def _flag(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{name} must be true or false, got {v!r}", name)
    return v


def _top_logprobs(body: dict, name: str, default: int | None) -> int | None:
    """chat's top_logprobs or the legacy endpoint's logprobs: how many most likely tokens."""
    v = body.get(name)
    if v is None:
        return default
    try:
        return check_top_logprobs(v, name)
    except ParamError as e:
        raise _bad(str(e), e.param) from None


def _unsupported(body: dict, name: str, ok: Callable[[Any], bool], what: str) -> None:
    if name in body and body[name] is not None and not ok(body[name]):
        raise _bad(f"{name} is not supported by this server ({what})", name, "unsupported_parameter")


def _parse_common(body: dict, chat: bool) -> dict:
    """Sampling and streaming parameters shared by both endpoints (OpenAI names, the
    presence / frequency penalties included; top_k, min_p and ignore_eos as extensions). A sampling parameter left out takes the OpenAI API's
    value (temperature 1, top_p 1, top_k and min_p off: tensorfold.request.PARAMS' `http`
    defaults), not the Python API's, and every one is passed on explicitly."""
    n = body.get("n")
    if n is not None and n != 1:
        if _is_int(n) and n > 1:
            raise _bad("n > 1 is not supported: send one request per choice", "n", "unsupported_parameter")
        raise _bad(f"n must be 1, got {n!r}", "n")
    _unsupported(body, "logit_bias", lambda v: v == {}, "only an empty map")
    _unsupported(body, "tools", lambda v: v == [], "no tool calling")
    _unsupported(body, "functions", lambda v: v == [], "no function calling")
    _unsupported(body, "response_format", lambda v: isinstance(v, dict) and v.get("type") == "text",
                 "only {'type': 'text'}")
    try:
        p: dict[str, Any] = parse_openai(body, chat)
    except ParamError as e:
        raise _bad(str(e), e.param) from None
    # max_tokens: None = up to the context (chat), HTTP_LEGACY_MAX_TOKENS on the legacy endpoint
    p["_max_tokens"] = p.pop("max_tokens")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop must be a string or a list of strings", "stop")
        if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise _bad(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
        p["stop"] = stops
    stream = _flag(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(so, dict):
            raise _bad("stream_options must be an object", "stream_options")
        include_usage = _flag(so, "include_usage")
    p["_stream"], p["_include_usage"] = stream, include_usage
    if chat:
        if _flag(body, "logprobs"):
            p["top_logprobs"] = _top_logprobs(body, "top_logprobs", 0)
        elif body.get("top_logprobs") is not None:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        lp = _top_logprobs(body, "logprobs", None)
        if lp is not None:
            p["top_logprobs"] = lp
        if _flag(body, "echo"):
            raise _bad("echo is not supported by this server", "echo", "unsupported_parameter")
        if body.get("suffix") not in (None, ""):
            raise _bad("suffix is not supported by this server", "suffix", "unsupported_parameter")
        bo = body.get("best_of")
        if bo is not None and bo != 1:
            raise _bad("best_of must be 1 (or absent)", "best_of", "unsupported_parameter")
    return p


def _parse_messages(msgs) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", "messages")
        try:
            role = check_role(m.get("role"), f"{where}.role")
        except ValueError as e:
            raise _bad(str(e), "messages") from None
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                               f"supported", "messages")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string or a list of text parts", "messages")
        out.append({"role": role, "content": content})
    return out


def _parse_prompt(prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(_is_int(t) for t in prompt):
            return prompt
        if len(prompt) == 1 and (isinstance(prompt[0], str) or
                                 (isinstance(prompt[0], list) and all(_is_int(t) for t in prompt[0]))):
            return prompt[0]
        if all(isinstance(x, (str, list)) for x in prompt):
            raise _bad("several prompts in one request are not supported: send one request per prompt",
                       "prompt", "unsupported_parameter")
    raise _bad("prompt must be a string, a list of token ids, or a list holding one of those", "prompt")


# -- responses ---------------------------------------------------------------------------
def _lp(v: float) -> float:
    return v if math.isfinite(v) else -9999.0


class _Logprobs:
    """Token strings for logprobs (a token's text may be part of a UTF-8 character: `bytes`
    has its exact bytes)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def piece(self, t: int) -> tuple[str, list[int]]:
        b = self.tok.token_to_piece(t, True)
        return b.decode("utf-8", "replace"), list(b)

    def chat(self, entries) -> list[dict]:
        out = []
        for e in entries:
            s, b = self.piece(e.token)
            tops = []
            for t, v in e.top:
                ts, tb = self.piece(t)
                tops.append({"token": ts, "logprob": _lp(v), "bytes": tb})
            out.append({"token": s, "logprob": _lp(e.logprob), "bytes": b, "top_logprobs": tops})
        return out

    def legacy(self, entries, offset: int) -> tuple[dict, int]:
        d = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s, _ = self.piece(e.token)
            d["tokens"].append(s)
            d["token_logprobs"].append(_lp(e.logprob))
            d["top_logprobs"].append({self.piece(t)[0]: _lp(v) for t, v in e.top})
            d["text_offset"].append(offset)
            offset += len(s)
        return d, offset


async def _next(q: asyncio.Queue) -> Delta:
    """The next Delta, merged with any others already queued (a slow reader gets fewer,
    bigger chunks)."""
    got = [await q.get()]
    while not got[-1].final and not q.empty():
        got.append(q.get_nowait())
    return Delta.merge(got)


async def _watch_disconnect(receive, sched: Scheduler, req) -> None:
    """Waits for the client to go away and then cancels `req` (aborted in the engine)."""
    try:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                sched.cancel(req)
                return
    except asyncio.CancelledError:
        raise
    except Exception:  # the server is closing the connection itself
        return


async def _tokenized(fn: Callable[..., list[int]], *args, param: str) -> list[int]:
    """Token ids from ``fn(*args)`` run in a worker thread; a refusal is a 400. The error
    crosses back as a message, not as an exception: an exception carried through the thread
    pool's future forms a reference cycle (future -> exception -> traceback -> the frame that
    awaited the future) that keeps a large request's parsed body and rendered prompt alive
    until a full garbage collection, which may never come."""
    def call():
        try:
            return fn(*args), None
        except (ValueError, TypeError) as e:
            return None, str(e)

    ids, err = await run_in_threadpool(call)
    if err is not None:
        raise _bad(err, param)
    return ids


def _delta_error(d: Delta) -> ApiError:
    e = d.error
    if isinstance(e, EngineFailed):
        return ApiError(500, f"the engine failed: {e}", None, "engine_failed")
    if isinstance(e, SchedulerClosed):
        return ApiError(503, str(e), code="shutting_down")
    if isinstance(e, ValueError):
        return _bad(str(e), None, "invalid_request")
    return _internal(e)


# -- the app -----------------------------------------------------------------------------
def create_app(config: ServerConfig, *, engine=None, loader: Callable[[], Any] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None,
               on_engine_failure: Callable[[BaseException], None] | None = None):
    """The ASGI app to run with uvicorn (the FastAPI app inside a guard; its ``.state`` is
    the server's state: ``.sched``, ``.engine``, ``.metrics``). Give a loaded `engine` (the
    app schedules it but does not close it), or a `loader` that returns one: it runs in a
    thread at startup (/ready says 503 until it returns; on_load_error is told when it
    raises) and the app closes the engine at shutdown. When the engine fails for good (its
    scheduler stops), every request it held gets a 500, /health and /ready answer 503, and
    on_engine_failure is told (on the scheduler thread)."""
    if (engine is None) == (loader is None):
        raise ValueError("give exactly one of engine and loader")
    for chat in (True, False):  # the request models, built now rather than at the first request
        openai_model(chat)
    state = _State(config, engine, loader, on_load_error, on_engine_failure)

    @asynccontextmanager
    async def lifespan(app):
        if state.engine is not None:
            state.start()
        else:
            state.load_thread = threading.Thread(target=state.load, name="tensorfold-load", daemon=True)
            state.load_thread.start()
        try:
            yield
        finally:
            await run_in_threadpool(state.shutdown)

    app = FastAPI(title="TensorFold", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.tf = state

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error").response()

    # -- probes --------------------------------------------------------------------------
    # /health: the process can serve (or is still loading); 503 once the engine failed, so a
    # liveness probe restarts it. /ready: the model is loaded and requests are served.
    def failure() -> BaseException | None:
        return state.engine_error or state.load_error

    @app.get("/health")
    async def health():
        err = failure()
        if err is not None:
            return _json({"status": "failed", "error": str(err)}, 503)
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready():
        sched = state.sched
        if sched is not None and not sched.closed:
            return _json({"status": "ready", "model": config.model_name})
        err = failure()
        if err is not None:
            return _json({"status": "failed", "error": str(err)}, 503)
        return _json({"status": "shutting_down" if state.stopping else "loading"}, 503)

    @app.get("/metrics")
    def metrics():  # a thread: reading the engine's stats waits for the step in progress
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- models --------------------------------------------------------------------------
    def model_card() -> dict:
        card = {"id": config.model_name, "object": "model", "created": state.created, "owned_by": "tensorfold"}
        if state.engine is not None:
            card["max_model_len"] = state.engine.context
        return card

    @app.get("/v1/models")
    async def list_models():
        return _json({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != config.model_name:
            raise ApiError(404, f"the model '{model_id}' does not exist (this server has '{config.model_name}')",
                           "model", "model_not_found")
        return _json(model_card())

    # -- completions ---------------------------------------------------------------------
    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        except RecursionError:
            raise _bad("the request body nests JSON too deeply", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_json")
        return body

    def check_model(body: dict) -> None:
        model = body.get("model")
        if model is None:
            raise _bad("model is required", "model", "missing_required_parameter")
        if model != config.model_name:
            raise ApiError(404, f"the model '{model}' does not exist (this server has '{config.model_name}')",
                           "model", "model_not_found")

    def fit(ids: list[int], p: dict, default_max: int | None) -> int:
        eng = state.engine
        n, ctx = len(ids), eng.context
        if n == 0:
            raise _bad("the prompt is empty", "messages" if default_max is None else "prompt")
        limit = state.max_prompt_tokens
        if n > limit:
            raise _bad(f"the prompt has {n} tokens, more than the {limit} this server accepts "
                       f"(context {ctx} tokens, at least one kept for the reply); shorten it",
                       "messages" if default_max is None else "prompt", "context_length_exceeded")
        mt = p["_max_tokens"]
        if mt is None:
            return ctx - n if default_max is None else min(default_max, ctx - n)
        if n + mt > ctx:
            raise _bad(f"this model's context is {ctx} tokens, but {n + mt} were requested ({n} in the prompt, "
                       f"{mt} to generate); lower max_tokens or shorten the prompt", "max_tokens",
                       "context_length_exceeded")
        return mt

    async def generate(request: Request, chat: bool, ids: list[int], p: dict, max_tokens: int) -> Response:
        sched = state.ready_scheduler()
        eng = state.engine
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        kwargs = {k: v for k, v in p.items() if not k.startswith("_")}
        try:
            req = sched.submit(ids, asyncio_sink(loop, q), max_tokens=max_tokens, stream=p["_stream"], **kwargs)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}", code="queue_full", headers={"Retry-After": "1"}) from None
        except EngineFailed as e:
            raise ApiError(503, f"the engine failed and this server cannot serve any more: {e}",
                           code="engine_failed") from None
        except SchedulerClosed as e:
            raise ApiError(503, str(e), code="shutting_down") from None
        except ValueError as e:
            raise _bad(str(e), "logprobs" if "logprobs" in str(e) else None) from None
        state.metrics.prompt_tokens.inc(len(ids))
        cid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": config.model_name, "system_fingerprint": FINGERPRINT}
        lpf = _Logprobs(eng.tokenizer)
        want_lp = "top_logprobs" in kwargs
        n_prompt = len(ids)

        def usage(n_gen: int) -> dict:
            u = {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}
            if req.spec is not None:  # an extension: the speculation behind this completion
                u["drafted_tokens"], u["accepted_tokens"] = req.spec
            return u

        if p["_stream"]:
            include_usage = p["_include_usage"]

            def chunk(choice: dict | None, use: dict | None = None) -> str:
                obj = dict(head, choices=[choice] if choice is not None else [])
                if include_usage:
                    obj["usage"] = use
                return f"data: {_dumps(obj)}\n\n"

            async def events() -> AsyncIterator[str]:
                watcher = asyncio.create_task(_watch_disconnect(request.receive, sched, req))
                offset = 0
                try:
                    if chat:
                        yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None})
                    while True:
                        d = await _next(q)
                        if d.error is not None:
                            yield f"data: {_dumps(_delta_error(d).body())}\n\n"
                            return
                        if d.finish_reason == "abort":  # the client went away
                            return
                        if d.text or d.logprobs:
                            lp = None
                            if want_lp:
                                if chat:
                                    lp = {"content": lpf.chat(d.logprobs or [])}
                                else:
                                    lp, offset = lpf.legacy(d.logprobs or [], offset)
                            if chat:
                                yield chunk({"index": 0, "delta": {"content": d.text}, "logprobs": lp,
                                             "finish_reason": None})
                            else:
                                yield chunk({"index": 0, "text": d.text, "logprobs": lp, "finish_reason": None})
                        if d.finish_reason is not None:
                            if chat:
                                yield chunk({"index": 0, "delta": {}, "logprobs": None,
                                             "finish_reason": d.finish_reason})
                            else:
                                yield chunk({"index": 0, "text": "", "logprobs": None,
                                             "finish_reason": d.finish_reason})
                            if include_usage:
                                yield chunk(None, usage(req.n_generated))
                            yield "data: [DONE]\n\n"
                            return
                finally:
                    watcher.cancel()
                    sched.cancel(req)  # a no-op when it finished

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        watcher = asyncio.create_task(_watch_disconnect(request.receive, sched, req))
        deltas = []
        try:
            while True:
                d = await _next(q)
                deltas.append(d)
                if d.final:
                    break
        finally:
            watcher.cancel()
            sched.cancel(req)
        d = Delta.merge(deltas)
        if d.error is not None:
            raise _delta_error(d)
        if d.finish_reason == "abort":
            raise ApiError(400, "the request was cancelled (the client closed the connection)",
                           code="client_disconnected")
        lp = None
        if want_lp:
            lp = {"content": lpf.chat(d.logprobs or [])} if chat else lpf.legacy(d.logprobs or [], 0)[0]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": d.text}, "logprobs": lp,
                      "finish_reason": d.finish_reason}
        else:
            choice = {"index": 0, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        return _json(dict(head, object="chat.completion" if chat else "text_completion", choices=[choice],
                          usage=usage(req.n_generated)))

    async def parsed(request: Request, chat: bool) -> tuple[dict, dict]:
        """The request's body and its common parameters, once the model is ready for it."""
        body = await read_body(request)
        state.ready_scheduler()
        check_model(body)
        return body, _parse_common(body, chat=chat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, p = await parsed(request, chat=True)
        messages = _parse_messages(body.pop("messages", None))
        del body  # a large request's parsed JSON is not kept alive by this frame
        ids = await _tokenized(state.engine._prompt_ids, None, messages, param="messages")
        del messages
        return await generate(request, True, ids, p, fit(ids, p, None))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, p = await parsed(request, chat=False)
        prompt = _parse_prompt(body.pop("prompt", None))
        del body
        eng = state.engine
        if isinstance(prompt, str):
            ids = await _tokenized(eng.tokenize, prompt, param="prompt")
        else:
            try:
                ids = eng._token_ids(prompt)
            except (ValueError, TypeError) as e:
                raise _bad(str(e), "prompt") from None
        return await generate(request, False, ids, p, fit(ids, p, HTTP_LEGACY_MAX_TOKENS))

    return _Guard(app, state)


# -- connections -------------------------------------------------------------------------
def guarded_http_protocol(header_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with two limits it lacks: a connection must deliver a complete
    request head within ``header_timeout`` seconds of opening (or of its previous response),
    else it is closed (half-open and slowloris connections cannot pile up); and at most
    ``max_connections`` are open at once: a new one beyond it closes the connection that has
    been waiting longest for a request head (a flood of idle connections cannot keep real
    clients out), or is itself refused when every other one is busy with a request."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    shed = {"count": 0, "logged": -math.inf}  # connections closed at the cap, for a rate-limited log

    def note_shed(loop, victim) -> None:
        shed["count"] += 1
        now = loop.time()
        if now - shed["logged"] >= 10:
            log.warning("%d connection(s) closed in the last 10 s at the connection cap (--max-connections %d), "
                        "the last from %s", shed["count"], max_connections, _peer(victim.client))
            shed["count"], shed["logged"] = 0, now

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            _no_delay(transport)
            self._head_timer = None
            self._idle_since = self.loop.time()
            if len(self.connections) > max_connections:  # closed ones leave the set a moment later
                live = [c for c in self.connections if not c.transport.is_closing()]
                if len(live) > max_connections:
                    idle = [c for c in live if c is not self and getattr(c, "_head_timer", None)]
                    victim = min(idle, key=lambda c: c._idle_since, default=self)
                    note_shed(self.loop, victim)
                    victim._cancel_head_timer()
                    victim.transport.close()
                    if victim is self:
                        return
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._idle_since = self.loop.time()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                log.debug("closing the connection from %s: no complete request head in %g s",
                          _peer(self.client), header_timeout)
                self.transport.close()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._cancel_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


def _no_delay(transport) -> None:
    """TCP_NODELAY on a connection. asyncio sets it only on sockets whose protocol number is
    IPPROTO_TCP, and a listening socket made by socket.socket()/create_server() has 0, as have
    the connections it accepts: without it every response (head and body written apart) waited
    for the client's delayed ACK, ~40 ms per request on Linux."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _peer(client) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


def _raise_fd_limit(want: int) -> None:
    """Lifts the soft limit on open files towards the hard one so --max-connections fits."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


# -- command line ------------------------------------------------------------------------
def serve(*, model_name: str, loader: Callable[[], Any], host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, max_body_bytes: int = 8 * 2**20, max_prompt_tokens: int | None = None,
          max_running: int = 32, max_queue: int = 64, log_level: str = "info", header_timeout: float = 10.0,
          keep_alive: float = 5.0, max_connections: int = 1024, exit_on_failure: bool = True) -> int:
    """Runs the server until SIGINT/SIGTERM (what `tensorfold serve` does). The model loads in
    the background while the port already answers /health. Returns the exit status; raises
    when the model failed to load, or when the engine failed while serving (unless
    ``exit_on_failure`` is False: the server then stays up answering 503)."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    actual = sock.getsockname()[1]
    failed: list[BaseException] = []
    engine_failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        if server is not None:
            server.should_exit = True

    def on_engine_failure(e: BaseException) -> None:
        # The requests it held have their error responses queued; uvicorn's graceful
        # shutdown lets them go out before the process exits.
        engine_failed.append(e)
        if exit_on_failure and server is not None:
            print(f"tensorfold: the engine failed: {e}; exiting so that a supervisor can restart the server "
                  f"(--no-exit-on-failure keeps it up)", file=sys.stderr, flush=True)
            server.should_exit = True

    config = ServerConfig(model_name=model_name, api_key=api_key or None, max_body_bytes=max_body_bytes,
                          max_prompt_tokens=max_prompt_tokens, max_running=max_running, max_queue=max_queue,
                          body_timeout=header_timeout)
    app = create_app(config, loader=loader, on_load_error=on_load_error, on_engine_failure=on_engine_failure)
    _raise_fd_limit(max_connections + 64)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                           access_log=log_level == "debug", timeout_keep_alive=keep_alive,
                                           http=guarded_http_protocol(header_timeout, max_connections)))
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    loopback = host in ("127.0.0.1", "::1", "localhost")
    print(f"tensorfold: serving '{model_name}' at http://{shown}:{actual}/v1 (health: /health, ready: /ready, "
          f"metrics: /metrics){'' if api_key else '; no API key'}", file=sys.stderr, flush=True)
    if not loopback and not api_key:
        print(f"tensorfold: warning: listening on {host} without an API key: anyone who can reach this port "
              f"can use the model (set --api-key or TENSORFOLD_API_KEY)", file=sys.stderr, flush=True)
    class _Stopped(Exception):
        pass

    def stopped(signum, frame):
        raise _Stopped

    # uvicorn handles SIGINT/SIGTERM itself (a graceful shutdown), then re-raises the signal
    # to the handler that was there before: ours, which turns it into a clean exit.
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    except _Stopped:
        pass
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
        sock.close()
    loading = app.state.load_thread
    if loading is not None and loading.is_alive():
        # Stopped while the model was loading (e.g. still connecting to the TP peer): the load
        # ends within its timeout and the engine is closed then; exiting under it would kill
        # a thread inside the native constructor.
        print("tensorfold: waiting for the model load in progress to end ...", file=sys.stderr, flush=True)
        loading.join()
    if failed:
        e = failed[0]
        raise e if isinstance(e, (ValueError, OSError, RuntimeError, MemoryError)) else RuntimeError(str(e))
    if engine_failed and exit_on_failure:
        raise RuntimeError(f"the engine failed while serving: {engine_failed[0]}")
    return 0
