"""The one request spec: each generation parameter's type, default and valid range, in one
table (PARAMS) that every layer reads:

- the Python API (Engine.generate / stream / chat, Scheduler.submit) takes its keyword
  defaults from it and checks arguments with `Param.check` (a wrong type is a TypeError,
  tensorfold.engine.ArgumentTypeError; a bad value a ValueError; both name the range);
- the command line (`tensorfold chat / generate`) makes its options from it: names, types,
  defaults and help, refused before a model loads (`Param.parse`);
- the HTTP server validates the sampling fields of /v1/completions and /v1/chat/completions
  bodies with a Pydantic model built from it (`openai_model`); a bad one is a 400 naming the
  parameter and the range.

The defaults rule. `Param.default` is TensorFold's own default, for the Python API and the
command line: llama.cpp's sampling defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05),
which suit a local model. An OpenAI client that leaves a parameter out expects the OpenAI API's
meaning instead (temperature 1, top_p 1, nothing else filtering), so the HTTP API has its own
value where that differs, in the same row (`Param.http["default"]`), and the same holds for a
range the OpenAI API narrows (temperature in [0, 2]). An explicit value means the same on
every layer.

This module needs no third-party package; pydantic (which the server has through FastAPI)
is imported by openai_model() only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from .util import INT32_MAX, ArgumentTypeError, check_bool, float_in, int_in, is_int, parse_in, range_text

# The native engine's limits (csrc/engine/engine.h: Engine::kMaxContext, kMaxKvTokens, and the
# sampler's top_logprobs limit), stated here so that every layer checks the same range.
MAX_CONTEXT = 2**24
MAX_KV_TOKENS = 2**30
MAX_TOP_LOGPROBS = 20
# OpenAI's legacy /v1/completions generates 16 tokens when max_tokens is absent; chat
# completions generate up to the end of the context.
HTTP_LEGACY_MAX_TOKENS = 16


@dataclass(frozen=True, eq=False)
class Param:
    """One request parameter: `kind` "int", "float", "bool" or "seed" (any integer, used
    modulo 2**64, or None for a random one); the range [lo, hi] ((lo, hi] when lo_open);
    `note` says what special values mean ("0 = off"); `help` what it does; `flags` its
    command-line options (none: not one); `http` what differs in the HTTP API (default, lo,
    hi, note, and `map`: values it takes as others, e.g. vLLM's top_k=-1 for 0)."""
    name: str
    kind: str
    default: Any
    lo: float = 0
    hi: float = INT32_MAX
    lo_open: bool = False
    note: str = ""
    help: str = ""
    flags: tuple[str, ...] = ()
    http: Mapping[str, Any] = field(default_factory=dict)

    # -- how the range is stated ------------------------------------------------------
    @property
    def range(self) -> str:
        """'an integer in [0, 2147483647]', 'a finite number in (0, 1]', ..."""
        if self.kind == "bool":
            return "True or False"
        if self.kind == "seed":
            return "an integer (used modulo 2**64)"
        return range_text(self.kind, self.lo, self.hi, self.lo_open)

    def _note(self) -> str:
        return f" ({self.note})" if self.note else ""

    def message(self, got: Any, name: str | None = None) -> str:
        """The message for a bad value in a request body: '<name> must be <range> (<note>), got
        <value>' (the Python API's ValueError says the same; bools and null are JSON's words)."""
        if self.kind == "bool":
            return f"{name or self.name} must be true or false, got {got!r}"
        if self.kind == "seed":
            return f"{name or self.name} must be an integer (used modulo 2**64) or null, got {got!r}"
        return f"{name or self.name} must be {self.range}{self._note()}, got {got!r}"

    # -- the Python API ---------------------------------------------------------------
    def check(self, v: Any, name: str | None = None) -> Any:
        """`v` checked for the Python API: ArgumentTypeError (a TypeError) for a wrong type,
        ValueError for a bad value; None is taken only where it is the default."""
        name = name or self.name
        if v is None and self.default is None:
            return None
        if self.kind == "int":
            return int_in(name, v, int(self.lo), int(self.hi), self._note())
        if self.kind == "float":
            return float_in(name, v, self.lo, self.hi, self.lo_open, self._note())
        if self.kind == "bool":
            return check_bool(name, v)
        if self.kind == "seed":
            if not is_int(v):
                raise ArgumentTypeError(f"{name} must be an integer (used modulo 2**64) or None, got {v!r}")
            return int(v)
        raise AssertionError(self.kind)

    # -- the command line -------------------------------------------------------------
    @property
    def cli_type(self):
        """argparse's `type` for this parameter's option: refuses a bad value before anything
        loads ('must be a finite number in (0, 1], got 0'); a seed is any integer."""
        if self.kind == "seed":
            return int  # argparse: "invalid int value: '1.5'"
        if self.kind not in ("int", "float"):
            raise ValueError(f"{self.name} is a flag, not an option with a value")
        return functools.partial(parse_in, kind=self.kind, lo=self.lo, hi=self.hi, lo_open=self.lo_open)

    def cli_help(self, default: Any = None) -> str:
        """The option's help: what it does, its range, what special values mean, its default."""
        default = self.default if default is None else default
        parts = [self.help]
        if self.kind == "float" or (self.kind == "int" and self.hi != INT32_MAX):
            parts.append(self.range.replace("a finite number", "a number"))
        if self.note:
            parts.append(self.note)
        shown = "random" if default is None and self.kind == "seed" else default
        return "; ".join(parts) + (f" (default {shown})" if self.kind != "bool" else "")


# The table. The order is the order of the checks (the first bad value is the one reported)
# and of the command-line options.
PARAMS: dict[str, Param] = {p.name: p for p in (
    Param("max_tokens", "int", 128, 0, INT32_MAX, help="tokens to generate at most", flags=("-n", "--max-tokens"),
          # HTTP: absent = up to the context (chat) or HTTP_LEGACY_MAX_TOKENS (/v1/completions);
          # chat asks for at least 1 (the legacy endpoint takes 0)
          http={"default": None, "lo": 1}),
    Param("temperature", "float", 0.8, 0.0, math.inf, note="0 = greedy", help="sampling temperature",
          flags=("--temperature", "--temp"), http={"default": 1.0, "hi": 2.0}),
    Param("top_k", "int", 40, 0, INT32_MAX, note="0 = off", help="sample among the k most likely tokens",
          flags=("--top-k",), http={"default": 0, "lo": -1, "note": "0 or -1 = off", "map": {-1: 0}}),
    Param("top_p", "float", 0.95, 0.0, 1.0, lo_open=True, note="1 = off",
          help="sample among the most likely tokens that make up this probability", flags=("--top-p",),
          http={"default": 1.0}),
    Param("min_p", "float", 0.05, 0.0, 1.0, note="0 = off",
          help="drop tokens less likely than this times the most likely one", flags=("--min-p",),
          http={"default": 0.0}),
    # OpenAI's penalties, over the tokens generated so far (as vLLM: the prompt's do not count)
    Param("presence_penalty", "float", 0.0, -2.0, 2.0, note="0 = off",
          help="lower the logit of every token already generated by this much (negative: raise it)",
          flags=("--presence-penalty",)),
    Param("frequency_penalty", "float", 0.0, -2.0, 2.0, note="0 = off",
          help="lower a generated token's logit by this much per time it was generated",
          flags=("--frequency-penalty",)),
    Param("seed", "seed", None, help="RNG seed for reproducible sampling", flags=("--seed",)),
    Param("ignore_eos", "bool", False, help="keep generating past end-of-sequence", flags=("--ignore-eos",)),
    # Python API only: the server takes OpenAI's logprobs / top_logprobs (same range)
    Param("logprobs", "int", None, 0, MAX_TOP_LOGPROBS, note="None = off",
          help="also return each token's log-probability and this many most likely tokens'"),
)}

# The sampling parameters of every request (those a Sampling holds), in PARAMS order.
SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "seed", "ignore_eos")
# TensorFold's defaults, by name (the Python API's keyword defaults).
DEFAULTS: dict[str, Any] = {name: p.default for name, p in PARAMS.items()}


class Sampling(NamedTuple):
    """A request's checked sampling parameters (seed None: a random one is drawn)."""
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    ignore_eos: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def check_sampling(**kwargs: Any) -> Sampling:
    """The Python API's sampling arguments checked in table order (a missing one takes its
    default); raises as Param.check does."""
    return Sampling(*(PARAMS[n].check(kwargs.get(n, PARAMS[n].default)) for n in SAMPLING))


# -- the HTTP API --------------------------------------------------------------------------
class ParamError(ValueError):
    """A bad value in an HTTP request body: `param` is the field's name (OpenAI's error schema)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# The fields of an OpenAI body the model checks: the sampling parameters, and on chat
# max_completion_tokens, the newer name of max_tokens (it wins when both are given).
_HTTP_FIELDS = SAMPLING


@functools.lru_cache(maxsize=None)
def _http_row(name: str, chat: bool) -> Param:
    """PARAMS[name] as the HTTP API takes it: its `http` values in place (and the legacy
    endpoint's max_tokens from 0)."""
    p = PARAMS["max_tokens" if name == "max_completion_tokens" else name]
    known = {f.name for f in dataclasses.fields(Param)}
    p = dataclasses.replace(p, **{k: v for k, v in p.http.items() if k in known})
    if p.name == "max_tokens" and not chat:
        p = dataclasses.replace(p, lo=0)
    return dataclasses.replace(p, name=name)


@functools.lru_cache(maxsize=2)
def openai_model(chat: bool):
    """The Pydantic model (strict: 1.0 is not an integer, "1" not a number, 1 not a bool) of
    the sampling fields of a /v1/chat/completions (chat) or /v1/completions body, built from
    PARAMS with the HTTP API's ranges. Every field may be absent or null. Other fields are
    ignored here; the server checks those it knows by hand."""
    from typing import Optional

    from pydantic import ConfigDict, Field, create_model

    names = _HTTP_FIELDS + (("max_completion_tokens",) if chat else ())
    fields = {}
    for name in names:
        p = _http_row(name, chat)
        if p.kind == "int":
            fields[name] = (Optional[int], Field(None, ge=int(p.lo), le=int(p.hi), description=p.help))
        elif p.kind == "float":
            bounds = {"gt" if p.lo_open else "ge": p.lo}
            if math.isfinite(p.hi):
                bounds["le"] = p.hi
            fields[name] = (Optional[float], Field(None, allow_inf_nan=False, description=p.help, **bounds))
        elif p.kind == "bool":
            fields[name] = (Optional[bool], Field(None, description=p.help))
        else:  # seed
            fields[name] = (Optional[int], Field(None, description=p.help))
    return create_model("ChatSampling" if chat else "CompletionSampling",
                        __config__=ConfigDict(strict=True, extra="ignore"), **fields)


def parse_openai(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The sampling parameters of an OpenAI request body, checked by openai_model(chat), with
    the HTTP API's defaults for those absent or null: {temperature, top_p, top_k, min_p,
    presence_penalty, frequency_penalty, seed, ignore_eos, max_tokens} (max_tokens None when absent: the endpoint decides). Raises
    ParamError naming the first bad field and its range."""
    from pydantic import ValidationError

    try:
        m = openai_model(chat).model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        name = str(err["loc"][0])
        raise ParamError(name, _http_row(name, chat).message(err.get("input"))) from None
    out: dict[str, Any] = {}
    for name in _HTTP_FIELDS:
        p = _http_row(name, chat)
        v = getattr(m, name)
        if name == "max_tokens" and chat and m.max_completion_tokens is not None:
            v = m.max_completion_tokens
        if v is None:
            v = p.default
        out[name] = p.http.get("map", {}).get(v, v) if is_int(v) else v
    return out


def check_top_logprobs(v: Any, name: str = "top_logprobs") -> int:
    """An HTTP request's top_logprobs / logprobs count: ParamError unless an integer in
    [0, MAX_TOP_LOGPROBS]."""
    if not is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
        p = dataclasses.replace(PARAMS["logprobs"], note="")
        raise ParamError(name, p.message(v, name))
    return int(v)
