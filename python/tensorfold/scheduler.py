"""One owner of a native engine for many concurrent callers (the HTTP server).

A Scheduler runs a thread that alone calls the native engine: it adds the submitted
requests, runs ``step()`` continuously while any request is unfinished (the engine batches
them: continuous batching), aborts cancelled ones (their KV blocks return to the pool) and
sleeps on a condition when there is nothing to do. Callers in any thread or asyncio task
submit a request with a *sink*, a callable that receives the request's Deltas in order; the
sink runs on the scheduler thread and must be quick and never block (see ``asyncio_sink``
and ``queue_sink``). Text is assembled on the scheduler thread by tokenizer.TextStream (the
same code as Engine.stream), so stop strings end the native request at once.

An exception from ``step()`` fails every request that was in the engine with that error
(each caller gets a final Delta with ``error`` set); the scheduler goes on serving the next
requests while the engine itself is still sound. When it is not (the model file changed
under it, or the engine was closed), the scheduler stops: every waiting, admitted and running
request gets the error, ``failure`` holds it and ``on_failure`` is called, so a server can
report it and exit. Waiting requests are bounded (``max_queue``): beyond it ``submit``
raises QueueFull instead of letting the backlog grow without end.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from . import native
from .engine import TokenLogprob
from .native import StepEvent
from .request import DEFAULTS, MAX_TOP_LOGPROBS, PARAMS, Sampling  # noqa: F401 - MAX_TOP_LOGPROBS: re-exported
from .tokenizer import TextStream

log = logging.getLogger("tensorfold.scheduler")

class QueueFull(RuntimeError):
    """The waiting queue is full; try again later."""


class SchedulerClosed(RuntimeError):
    """The scheduler is shut down (or shutting down)."""


class EngineFailed(RuntimeError):
    """The engine failed while computing a request (not the request's fault); ``cause`` is
    the engine's error."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class Delta:
    """What one engine step produced for one request. ``text`` is safe to show (whole UTF-8
    characters, no part of a stop string); ``tokens`` are the ids generated in the step;
    the last Delta of a request has ``finish_reason`` ("stop", "length" or "abort" when
    cancelled) or ``error`` (the exception that ended it) set."""
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: BaseException | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @classmethod
    def merge(cls, deltas: Sequence["Delta"]) -> "Delta":
        """One Delta carrying several in order (text and tokens joined, the final state kept)."""
        if len(deltas) == 1:
            return deltas[0]
        out = cls()
        texts = []
        for d in deltas:
            texts.append(d.text)
            out.tokens.extend(d.tokens)
            if d.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.extend(d.logprobs)
            out.finish_reason = out.finish_reason or d.finish_reason
            out.error = out.error or d.error
        out.text = "".join(texts)
        return out


class Request:
    """A submitted generation (the handle ``submit`` returns; pass it to ``cancel``)."""

    __slots__ = ("prompt_ids", "sampling", "eog_ids", "top_logprobs", "sink", "text", "rid", "state",
                 "cancelled", "n_generated", "t_submit", "t_first", "t_last", "finish_reason", "error", "held",
                 "spec")

    def __init__(self, prompt_ids: list[int], sampling: Sampling, eog_ids: list[int], top_logprobs: int,
                 text: TextStream, sink: Callable[[Delta], None], stream: bool = True):
        self.held: list[Delta] | None = None if stream else []  # not streamed: Deltas kept until the last
        self.prompt_ids = prompt_ids
        self.sampling = sampling  # checked, with its seed drawn
        self.eog_ids = eog_ids
        self.top_logprobs = top_logprobs  # -1: off
        self.sink = sink
        self.text = text
        self.rid: int | None = None  # native id while in the engine
        self.state = "waiting"  # -> "running" -> "done"
        self.cancelled = False
        self.n_generated = 0
        self.spec: tuple[int, int] | None = None  # speculation: (drafted, accepted) once finished
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.state == "done"


class Observer:
    """Hooks the scheduler calls on its thread (metrics); the defaults do nothing."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, req: Request) -> None: ...


# Schedulers still open at interpreter exit are closed first (this runs before the Engine's
# own exit handler, registered earlier): their thread must not be inside a native step when
# Python finalizes.
_live: "weakref.WeakSet[Scheduler]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for sched in list(_live):
        sched.close()


class Scheduler:
    """Drives ``engine`` (a tensorfold.Engine) from one thread; see the module docstring.

    max_running: requests in the engine at once (the rest wait, in order of arrival).
    max_queue: waiting requests beyond which submit raises QueueFull.
    While the scheduler is open the engine's own generate/stream refuse to run (they would
    take the scheduler's events); close() gives the engine back (it does not close it).
    """

    def __init__(self, engine, *, max_running: int = 32, max_queue: int = 64, observer: Observer | None = None,
                 on_failure: Callable[[BaseException], None] | None = None):
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        engine._native()  # raises when it is closed
        if engine._owner is not None:
            raise RuntimeError("this engine is already driven by a scheduler")
        self.engine = engine
        self.max_running = max_running
        self.max_queue = max_queue
        # what the native build says it can do (an older one that does not say: nothing extra)
        self.supports_logprobs = bool(native.capabilities().get("logprobs", False))
        self._obs = observer or Observer()
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._cancels: list[Request] = []
        self._running: dict[int, Request] = {}  # native id -> request; scheduler thread only
        self._admitting: list[Request] = []  # taken from _waiting, not yet in _running; same thread
        self._n_running = 0
        self._closing = False
        self._on_failure = on_failure
        self.failure: BaseException | None = None  # what stopped the scheduler, when it failed
        engine._owner = self
        self._thread = threading.Thread(target=self._main, name="tensorfold-scheduler", daemon=True)
        self._thread.start()
        _live.add(self)

    # -- callers' side (any thread) ----------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], sink: Callable[[Delta], None], *,
               max_tokens: int = DEFAULTS["max_tokens"], temperature: float = DEFAULTS["temperature"],
               top_k: int = DEFAULTS["top_k"], top_p: float = DEFAULTS["top_p"], min_p: float = DEFAULTS["min_p"],
               presence_penalty: float = DEFAULTS["presence_penalty"],
               frequency_penalty: float = DEFAULTS["frequency_penalty"],
               seed: int | None = DEFAULTS["seed"], stop: str | Sequence[str] | None = None,
               ignore_eos: bool = DEFAULTS["ignore_eos"], top_logprobs: int | None = None,
               stream: bool = True) -> Request:
        """Queues a generation; Deltas go to ``sink``: each as it is produced, or with
        ``stream=False`` a single one at the end (the caller waits for the whole answer anyway,
        and one hand-off instead of one per token keeps the serving threads off the CPUs the
        engine computes on). The parameters are Engine.generate's (tensorfold.request.PARAMS:
        TensorFold's defaults; the server passes every one); bad ones raise as there (TypeError
        or ValueError), QueueFull when too many wait, SchedulerClosed after close."""
        eng = self.engine
        ids = eng._token_ids(prompt_ids)
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= eng.context:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context is {eng.context}")
        spec = eng._request(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, seed=seed, ignore_eos=ignore_eos)
        k = -1
        if top_logprobs is not None:
            if not self.supports_logprobs:
                raise ValueError("logprobs not supported by this build")
            k = PARAMS["logprobs"].check(top_logprobs, "top_logprobs")
        req = Request(ids, spec.sampling, spec.eog_ids, k, TextStream(eng.tokenizer, eng._stops(stop)), sink,
                      stream)
        with self._cv:
            if self._closing:
                if self.failure is not None:
                    raise EngineFailed(self.failure)
                raise SchedulerClosed("the server is shutting down")
            # Requests that the next step admits (free running slots) do not count as queued;
            # the others do, also while a long step keeps the thread from admitting anyone.
            free = max(0, self.max_running - self._n_running)
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFull(f"too many requests are waiting ({len(self._waiting)}); try again later")
            self._waiting.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Ends ``req`` (its last Delta has finish_reason "abort"); its native request is
        aborted and its KV blocks freed before the next step. A finished one is left as is."""
        deliver = False
        with self._cv:
            if req.state == "done" or req.cancelled:
                return
            req.cancelled = True
            if req.state == "waiting":
                try:
                    self._waiting.remove(req)
                except ValueError:  # being admitted right now: the thread sees `cancelled`
                    pass
                else:
                    req.state = "done"
                    req.finish_reason = "abort"
                    deliver = True
            if not deliver:
                self._cancels.append(req)
                self._cv.notify()
        if deliver:
            self._deliver(req, Delta(finish_reason="abort"))

    def close(self, timeout: float | None = None) -> None:
        """Stops the thread (after the step in progress), ends every request with
        SchedulerClosed and gives the engine back. Calling it again does nothing."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closing

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return self._n_running

    def stats(self) -> dict:
        """The engine's stats (waits for the step in progress) with the scheduler's counts."""
        st = self.engine.stats()
        st["queue_depth"] = self.queue_depth
        st["running_requests"] = self.n_running
        return st

    def stream(self, prompt_ids: Sequence[int], **kwargs) -> Iterator[Delta]:
        """Blocking convenience: submit and yield the Deltas (cancels when the iterator is
        closed early)."""
        q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        req = self.submit(prompt_ids, q.put, **kwargs)
        try:
            while True:
                d = q.get()
                yield d
                if d.final:
                    return
        finally:
            self.cancel(req)

    # -- scheduler thread ----------------------------------------------------------------
    def _deliver(self, req: Request, delta: Delta) -> None:
        if req.held is not None:
            req.held.append(delta)
            if not delta.final:
                return
            delta = Delta.merge(req.held)
            req.held = []
        if delta.final:
            req.state = "done"
            if req.finish_reason is None and req.error is None:
                req.finish_reason, req.error = delta.finish_reason, delta.error
            try:
                self._obs.finished(req)
            except Exception:  # metrics must never break serving
                log.exception("scheduler observer failed")
        try:
            req.sink(delta)
        except Exception:
            # e.g. the caller's event loop is gone: nobody reads this request any more
            if not delta.final:
                log.debug("sink of a request failed; cancelling it", exc_info=True)
                self.cancel(req)

    def _main(self) -> None:
        err: BaseException | None = None
        try:
            while True:
                with self._cv:
                    while not (self._closing or self._waiting or self._cancels or self._running):
                        self._cv.wait()
                    if self._closing:
                        break
                    cancels, self._cancels = self._cancels, []
                    admit = self._admitting
                    while self._waiting and len(self._running) + len(admit) < self.max_running:
                        req = self._waiting.popleft()
                        req.state = "running"
                        admit.append(req)
                    self._n_running = len(self._running) + len(admit)
                self._work(cancels, admit)
                self._n_running = len(self._running)
        except BaseException as e:  # the engine is unusable (closed, its file changed), or a bug here
            if isinstance(e, (ValueError, RuntimeError, OSError)):
                log.error("the scheduler stopped: %s: %s", type(e).__name__, e)
            else:
                log.exception("the scheduler stopped on an unexpected error")
            err = e
        finally:
            self._shutdown(err)

    def _work(self, cancels: list[Request], admit: list[Request]) -> None:
        # The native engine serialises its own methods; the Python Engine's lock is not held
        # here, so stats() from other threads gets in between steps (a lock re-taken at once
        # after every step would starve them).
        core = self.engine._native()  # raises when the engine is closed or its model file changed
        for req in cancels:
            if req.state != "done" and req.rid is not None:
                self._running.pop(req.rid, None)
                core.abort(req.rid)
                req.rid = None
                self._deliver(req, Delta(finish_reason="abort"))
        while admit:
            req = admit.pop(0)
            if req.cancelled:
                self._deliver(req, Delta(finish_reason="abort"))
                continue
            try:
                rid = native.add_request(core, req.prompt_ids, req.sampling, eog_ids=req.eog_ids,
                                         top_logprobs=req.top_logprobs)
            except Exception as e:
                self._deliver(req, Delta(error=e))
                continue
            req.rid = rid
            self._running[rid] = req
        if not self._running:
            return
        try:
            events = native.step(core)
        except Exception as e:
            log.error("engine step failed: %s: %s (failing %d request(s))", type(e).__name__, e,
                      len(self._running))
            self._fail_running(core, EngineFailed(e))
            self.engine._native()  # an engine that cannot go on stops the scheduler now
            return
        now = time.monotonic()
        for ev in events:
            self._on_event(core, ev, now)
        if not events and self._running and not core.has_unfinished():
            self._fail_running(core, RuntimeError("the engine dropped the request(s) without finishing them"))

    def _on_event(self, core, ev: StepEvent, now: float) -> None:
        rid, token, finished, why = ev.request_id, ev.token, ev.finished, ev.reason
        req = self._running.get(rid)
        if req is None:
            return
        if ev.spec is not None:
            req.spec = ev.spec
        lps = None
        if token >= 0:
            req.n_generated += 1
            if req.t_first is None:
                req.t_first = now
                self._obs.first_token(now - req.t_submit)
            else:
                self._obs.inter_token(now - req.t_last)
            req.t_last = now
            if req.top_logprobs >= 0 and ev.logprob is not None \
                    and not (finished and why == "stop" and token in req.text._eog):
                lps = [TokenLogprob.from_event(ev)]
        if finished and why == "abort" and not req.cancelled:
            self._running.pop(rid, None)
            req.rid = None
            self._deliver(req, Delta(error=RuntimeError("the engine aborted the request")))
            return
        text, reason = req.text.feed(token, finished, why)
        if reason is not None:
            self._running.pop(rid, None)
            if not finished:  # a stop string matched: end the native request now
                core.abort(rid)
            req.rid = None
        self._deliver(req, Delta(text=text, tokens=[token] if token >= 0 else [], logprobs=lps,
                                 finish_reason=reason))

    def _fail_running(self, core, err: BaseException) -> None:
        """Ends every running request with `err` (aborted in the engine when there is one)."""
        running, self._running = self._running, {}
        for rid, req in running.items():
            if core is not None:
                try:
                    core.abort(rid)
                except Exception:
                    pass
            req.rid = None
            self._deliver(req, Delta(error=err))

    def _shutdown(self, err: BaseException | None) -> None:
        with self._cv:
            self._closing = True
            self.failure = err
            waiting = self._admitting + list(self._waiting)
            self._admitting = []
            self._waiting.clear()
            self._cancels.clear()
        if err is None:
            closed: BaseException = SchedulerClosed("the server is shutting down")
        else:
            closed = err if isinstance(err, EngineFailed) else EngineFailed(err)
        try:
            for req in waiting:
                if req.state != "done":
                    self._deliver(req, Delta(error=closed))
            self._fail_running(self.engine._core, closed)
        finally:
            self._n_running = 0
            self.engine._owner = None
        if err is not None and self._on_failure is not None:
            try:
                self._on_failure(err)
            except Exception:
                log.exception("the scheduler's failure callback failed")


def asyncio_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[Delta], None]:
    """A sink that hands each Delta to ``q`` on ``loop`` (thread-safe). Raises when the loop
    is closed, which makes the scheduler cancel the request."""
    def sink(delta: Delta) -> None:
        loop.call_soon_threadsafe(q.put_nowait, delta)
    return sink
