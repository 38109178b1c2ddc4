"""The one place the Python layer drives the native engine's requests: what the build can do
(capabilities), submitting a request (add_request) and stepping (step, which hands back named
StepEvents). Engine (its own streams) and Scheduler (the server) both go through here, so a
change in the native call's arguments or in the format of its results is handled once.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from . import _core
from .request import Sampling


def capabilities() -> dict:
    """What this build of the native core can do, as it says itself (_core.capabilities()):
    e.g. {"logprobs": True, "backends": ["cpu"], "isa": "avx512", "ibverbs": False}. An older
    core without the function: {} (nothing is assumed)."""
    fn = getattr(_core, "capabilities", None)
    return dict(fn()) if fn is not None else {}


class StepEvent(NamedTuple):
    """What one native step produced for one request: the token (-1 when the request ended
    without one, e.g. max_tokens 0 or an abort), whether the request finished and why ("stop",
    "length", "abort"), and, for a request that asked for logprobs, the token's log-probability
    and the most likely tokens at its position as (token, logprob) pairs, most likely first."""
    request_id: int
    token: int
    finished: bool
    reason: str
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    spec: tuple[int, int] | None = None  # finishing event of a speculating request: (drafted, accepted)

    @classmethod
    def from_native(cls, ev: Any) -> "StepEvent":
        """From the native step's result: an object with these attributes, or the tuple
        (id, token, finished, reason[, (logprob, [(token, logprob), ...]) or None])."""
        if hasattr(ev, "request_id"):
            top = getattr(ev, "top", None)
            return cls(ev.request_id, ev.token, ev.finished, ev.reason, getattr(ev, "logprob", None),
                       None if top is None else list(top))
        rid, token, finished, reason = ev[:4]
        lp = ev[4] if len(ev) > 4 else None
        spec = (int(ev[5][0]), int(ev[5][1])) if len(ev) > 5 and ev[5] is not None else None
        if lp is None:
            return cls(rid, token, finished, reason, spec=spec)
        return cls(rid, token, finished, reason, float(lp[0]), [(int(t), float(v)) for t, v in lp[1]], spec)


def step(core) -> list[StepEvent]:
    """One step of the native engine `core` (every unfinished request advances): its events."""
    return [StepEvent.from_native(ev) for ev in core.step()]


def add_request(core, prompt: Sequence[int], sampling: Sampling, *, max_tokens: int | None = None,
                eog_ids: Sequence[int] = (), top_logprobs: int = -1, speculative: str = "", resumed: int = 0) -> int:
    """Submits a request to the native engine `core`; returns its id. `sampling.seed` must be
    set (0..2**64-1); max_tokens (default sampling.max_tokens) is what is left to generate;
    top_logprobs -1: no log-probabilities, k >= 0: the token's and the k most likely; speculative
    "" the engine's draft source, "none", "lookup" or "draft"; resumed: the prompt's last tokens
    that the request generated before it was parked (they count for the penalties)."""
    kw = {"top_logprobs": top_logprobs} if top_logprobs >= 0 else {}  # an older core does not take it
    if sampling.presence_penalty or sampling.frequency_penalty:
        kw.update(presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
                  resumed=resumed)
    if speculative:
        kw["speculative"] = speculative
    return core.add_request(prompt, sampling.max_tokens if max_tokens is None else max_tokens,
                            sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed,
                            list(eog_ids), sampling.ignore_eos, **kw)
