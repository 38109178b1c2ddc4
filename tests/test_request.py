"""The one request spec (tensorfold.request.PARAMS) and what is built on it: every layer takes
its defaults and ranges from the table (the Python API's keyword defaults, the command line's
options, the HTTP API's Pydantic model with OpenAI's defaults for what a client leaves out);
the shared helpers (tensorfold.util) and the one place that steps the native engine
(tensorfold.native). None of these tests loads a model."""
from __future__ import annotations

import argparse
import inspect
import math
import subprocess
import sys

import numpy as np
import pytest

from tensorfold import cli, native, request, util
from tensorfold.engine import ArgumentTypeError, Engine
from tensorfold.request import DEFAULTS, PARAMS, SAMPLING, ParamError, check_sampling, parse_openai
from tensorfold.scheduler import Scheduler


# -- one table: every layer reads it ----------------------------------------------------------
def test_tensorfold_defaults_are_llama_cpps():
    assert {n: DEFAULTS[n] for n in SAMPLING} == dict(max_tokens=128, temperature=0.8, top_k=40, top_p=0.95,
                                                      min_p=0.05, presence_penalty=0.0, frequency_penalty=0.0,
                                                      seed=None, ignore_eos=False)
    assert DEFAULTS["logprobs"] is None


@pytest.mark.parametrize("fn", [Engine.generate, Engine.stream, Scheduler.submit],
                         ids=["Engine.generate", "Engine.stream", "Scheduler.submit"])
def test_python_api_defaults_are_the_tables(fn):
    sig = inspect.signature(fn).parameters
    for name in SAMPLING:
        assert sig[name].default == DEFAULTS[name], (fn.__qualname__, name)
    if "logprobs" in sig:
        assert sig["logprobs"].default == DEFAULTS["logprobs"]


def _actions(parser: argparse.ArgumentParser, command: str) -> dict:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {a.dest: a for a in sub._actions}


def test_cli_options_are_the_tables():
    parser = cli.build_parser()
    for command, n_default in (("generate", 128), ("chat", 512)):
        acts = _actions(parser, command)
        for name, spec in PARAMS.items():
            if not spec.flags or (name == "ignore_eos" and command == "chat"):
                assert name not in acts, (command, name)  # logprobs: Python only; chat never ignores EOS
                continue
            a = acts[name]
            assert tuple(a.option_strings) == spec.flags
            assert a.default == (n_default if name == "max_tokens" else spec.default), (command, name)
            assert spec.help in a.help, (command, name)
            if spec.note:
                assert spec.note in a.help
    # the commands' defaults as parsed
    a = parser.parse_args(["generate", "m.gguf"])
    assert cli._sampling(a) == {n: DEFAULTS[n] for n in SAMPLING}
    a = parser.parse_args(["chat"])
    assert cli._sampling(a) == {**{n: DEFAULTS[n] for n in SAMPLING if n != "ignore_eos"}, "max_tokens": 512}


def test_cli_help_states_ranges_notes_and_defaults():
    r = subprocess.run([sys.executable, "-m", "tensorfold", "generate", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for piece in ("sampling options:", "engine options:", "tensor parallel",
                  "a number in (0, 1]; 1 = off (default 0.95)",
                  "a number >= 0; 0 = greedy (default 0.8)", "0 = off (default 40)",
                  "a number in [0, 1]; 0 = off (default 0.05)", "(default 128)", "--ignore-eos", "--peer",
                  "--memory-budget", "--load-timeout"):
        assert piece in text, piece
    r = subprocess.run([sys.executable, "-m", "tensorfold", "chat", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert "(default 512)" in " ".join(r.stdout.split()) and "--ignore-eos" not in r.stdout


def test_parent_parsers_are_shared_not_copied_per_command():
    """chat, generate and serve take the same engine and TP options (one definition each);
    the worker takes the engine options and the TP link's, not --peer."""
    parser = cli.build_parser()
    engine_opts = {"threads", "context", "kv_tokens", "memory_budget"}
    link = {"rails", "tp_timeout", "transport", "load_timeout", "token"}
    for command in ("chat", "generate", "serve"):
        acts = _actions(parser, command)
        assert engine_opts | link | {"tp", "peer"} <= set(acts), command
    w = _actions(parser, "worker")
    assert engine_opts | link | {"listen", "wait"} <= set(w) and "peer" not in w
    assert w["tp"].choices == (2,)
    first = _actions(parser, "chat")["context"]
    assert all(_actions(parser, c)["context"] is first for c in ("generate", "serve", "worker"))


# -- the Python API's checks --------------------------------------------------------------------
def test_check_sampling_types_ranges_and_numpy():
    s = check_sampling(max_tokens=np.int64(5), temperature=np.float32(0.5), top_k=np.uint8(3), seed=np.int64(-1),
                       ignore_eos=np.bool_(True))
    assert s == (5, 0.5, 3, 0.95, 0.05, 0.0, 0.0, -1, True) and type(s.max_tokens) is int and type(s.ignore_eos) is bool
    assert check_sampling().temperature == 0.8 and check_sampling(temperature=0).greedy
    assert check_sampling(top_k=1, temperature=1.0).greedy and not check_sampling().greedy
    with pytest.raises(ArgumentTypeError, match=r"top_p must be a finite number in \(0, 1\] \(1 = off\), got '1'"):
        check_sampling(top_p="1")
    with pytest.raises(ValueError, match=r"min_p must be a finite number in \[0, 1\] \(0 = off\), got 2") as e:
        check_sampling(min_p=2)
    assert not isinstance(e.value, TypeError)
    with pytest.raises(ArgumentTypeError, match="ignore_eos must be True or False, not int"):
        check_sampling(ignore_eos=1)
    # the first bad one in the table's order is the one reported
    with pytest.raises(ValueError, match="max_tokens"):
        check_sampling(temperature=-1, max_tokens=-1)


# -- the HTTP API: OpenAI's defaults, the same ranges, Pydantic's strict types -------------------
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_http_defaults_are_openais(chat):
    p = parse_openai({"model": "m", "messages": []}, chat)
    assert p == dict(max_tokens=None, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0,
                     frequency_penalty=0.0, seed=None, ignore_eos=False)
    # null is absent
    assert parse_openai({k: None for k in p}, chat) == p
    # every default is in the table's row
    for name, v in p.items():
        assert PARAMS[name].http.get("default", PARAMS[name].default) == v, name


def test_http_values_and_mappings():
    p = parse_openai(dict(temperature=0, top_k=-1, top_p=0.5, min_p=0.1, seed=2**70, ignore_eos=True, max_tokens=7,
                          presence_penalty=-1.5, frequency_penalty=2),
                     chat=False)
    assert p == dict(max_tokens=7, temperature=0.0, top_k=0, top_p=0.5, min_p=0.1, presence_penalty=-1.5,
                     frequency_penalty=2.0, seed=2**70, ignore_eos=True)
    assert type(p["temperature"]) is float
    assert parse_openai(dict(max_tokens=3, max_completion_tokens=5), chat=True)["max_tokens"] == 5
    assert parse_openai(dict(max_tokens=3), chat=True)["max_tokens"] == 3
    assert parse_openai(dict(max_tokens=0), chat=False)["max_tokens"] == 0  # the legacy endpoint takes 0


@pytest.mark.parametrize("body,param,message", [
    ({"temperature": 2.5}, "temperature", "temperature must be a finite number in [0, 2] (0 = greedy), got 2.5"),
    ({"temperature": -1}, "temperature", "temperature must be a finite number in [0, 2] (0 = greedy), got -1"),
    ({"temperature": math.nan}, "temperature", "temperature must be a finite number in [0, 2] (0 = greedy), got nan"),
    ({"temperature": 10**400}, "temperature", None),
    ({"temperature": True}, "temperature", "temperature must be a finite number in [0, 2] (0 = greedy), got True"),
    ({"temperature": "1"}, "temperature", "temperature must be a finite number in [0, 2] (0 = greedy), got '1'"),
    ({"top_p": 0}, "top_p", "top_p must be a finite number in (0, 1] (1 = off), got 0"),
    ({"top_k": -5}, "top_k", "top_k must be an integer in [-1, 2147483647] (0 or -1 = off), got -5"),
    ({"top_k": 2.0}, "top_k", "top_k must be an integer in [-1, 2147483647] (0 or -1 = off), got 2.0"),
    ({"top_k": 2**31}, "top_k", None),
    ({"min_p": 1.5}, "min_p", "min_p must be a finite number in [0, 1] (0 = off), got 1.5"),
    ({"seed": "x"}, "seed", "seed must be an integer (used modulo 2**64) or null, got 'x'"),
    ({"seed": 1.0}, "seed", None),
    ({"ignore_eos": 1}, "ignore_eos", "ignore_eos must be true or false, got 1"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer in [1, 2147483647], got 0"),
    ({"max_tokens": -5}, "max_tokens", None),
    ({"max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be an integer in [1, 2147483647], got 0"),
])
def test_http_errors_name_the_field_and_its_range(body, param, message):
    with pytest.raises(ParamError) as e:
        parse_openai(dict(model="m", **body), chat=True)
    assert e.value.param == param and " must be " in str(e.value)
    if message is not None:
        assert str(e.value) == message
    if param == "max_completion_tokens":
        return
    if param != "max_tokens":  # the legacy endpoint refuses the same (max_tokens: from 0)
        with pytest.raises(ParamError):
            parse_openai(body, chat=False)


def test_a_bad_value_reads_the_same_in_python_and_http():
    """Where the ranges agree, the Python API's ValueError and the HTTP 400 say the same words."""
    for name, v in (("top_p", 0), ("min_p", 1.5), ("top_p", 1.5)):
        with pytest.raises(ValueError) as py:
            check_sampling(**{name: v})
        with pytest.raises(ParamError) as http:
            parse_openai({name: v}, chat=True)
        assert str(py.value) == str(http.value)


def test_top_logprobs_range():
    assert request.check_top_logprobs(20) == 20 and request.check_top_logprobs(0) == 0
    for bad in (21, -1, 1.0, True, "3"):
        with pytest.raises(ParamError, match=r"^top_logprobs must be an integer in \[0, 20\], got "):
            request.check_top_logprobs(bad)
    with pytest.raises(ParamError) as e:
        request.check_top_logprobs(30, "logprobs")
    assert e.value.param == "logprobs"


def test_the_model_is_pydantic_and_strict():
    pydantic = pytest.importorskip("pydantic")
    m = request.openai_model(True)
    assert issubclass(m, pydantic.BaseModel)
    schema = m.model_json_schema()["properties"]
    assert set(schema) == set(SAMPLING) | {"max_completion_tokens"}
    assert "max_completion_tokens" not in request.openai_model(False).model_json_schema()["properties"]


def test_import_tensorfold_does_not_import_pydantic():
    """The spec needs no third-party package: the Engine and the CLI run without pydantic."""
    code = "import sys, tensorfold, tensorfold.cli, tensorfold.request; print('pydantic' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


# -- tensorfold.native: capabilities and steps ----------------------------------------------------
def test_capabilities_come_from_the_native_module(monkeypatch):
    from tensorfold import _core

    if hasattr(_core, "capabilities"):
        caps = native.capabilities()
        assert isinstance(caps, dict) and caps == _core.capabilities()
        assert caps["logprobs"] is True and "cpu" in caps["backends"] and caps["isa"] == _core.cpu_isa()
    monkeypatch.setattr(_core, "capabilities", lambda: {"logprobs": False, "backends": ["cpu"]}, raising=False)
    assert native.capabilities() == {"logprobs": False, "backends": ["cpu"]}
    monkeypatch.delattr(_core, "capabilities")
    assert native.capabilities() == {}  # an older core: nothing is assumed


def test_step_events_from_the_native_formats():
    ev = native.StepEvent.from_native((3, 17, False, ""))
    assert ev == native.StepEvent(3, 17, False, "") and ev.logprob is None and ev.top is None
    assert native.StepEvent.from_native((3, -1, True, "length", None)).top is None
    ev = native.StepEvent.from_native((4, 9, True, "stop", (-0.5, [(9, -0.5), (2, -1.25)])))
    assert (ev.request_id, ev.token, ev.finished, ev.reason) == (4, 9, True, "stop")
    assert ev.logprob == -0.5 and ev.top == [(9, -0.5), (2, -1.25)]
    assert native.StepEvent.from_native((4, 9, False, "", (-0.5, []))).top == []

    class Obj:  # a future native step result: objects with the same attributes
        request_id, token, finished, reason, logprob, top = 5, 1, False, "", -2.0, ((1, -2.0),)

    assert native.StepEvent.from_native(Obj()) == native.StepEvent(5, 1, False, "", -2.0, [(1, -2.0)])

    class Core:
        def step(self):
            return [(1, 2, False, ""), (2, 3, True, "stop", (-0.1, [(3, -0.1)]))]

    assert [e.request_id for e in native.step(Core())] == [1, 2]


def test_add_request_passes_the_checked_sampling():
    got = {}

    class Core:
        def add_request(self, *args, **kw):
            got["args"], got["kw"] = args, kw
            return 7

    s = check_sampling(max_tokens=9, temperature=0.0, seed=3)
    assert native.add_request(Core(), [1, 2], s, eog_ids=[5]) == 7
    assert got["args"] == ([1, 2], 9, 0.0, 40, 0.95, 0.05, 3, [5], False) and got["kw"] == {}
    native.add_request(Core(), [1], s, max_tokens=2, top_logprobs=4)
    assert got["args"][1] == 2 and got["kw"] == {"top_logprobs": 4}


# -- tensorfold.util -------------------------------------------------------------------------------
def test_is_int_and_is_number():
    for v in (3, np.int64(3), np.uint16(3), 2**100):
        assert util.is_int(v) and util.is_number(v)
    for v in (True, np.bool_(True), 3.0, "3", None):
        assert not util.is_int(v)
    assert util.is_number(np.float32(1.5)) and not util.is_number(True) and not util.is_number("1")
    assert util.is_bool(np.bool_(False)) and util.is_bool(True) and not util.is_bool(1)


def test_argument_checks_state_the_range():
    assert util.range_text("int", 0, 20) == "an integer in [0, 20]"
    assert util.range_text("float", 0.0, math.inf) == "a finite number >= 0"
    assert util.range_text("float", 0.0, math.inf, lo_open=True) == "a finite number > 0"
    assert util.range_text("float", 0.0, 1.0, lo_open=True) == "a finite number in (0, 1]"
    with pytest.raises(ArgumentTypeError, match=r"^x must be an integer in \[1, 2\] \(n\), got 1.0 \(float\)$"):
        util.int_in("x", 1.0, 1, 2, " (n)")
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0, got 0$"):
        util.float_in("x", 0, 0.0, lo_open=True)
    assert util.parse_in("5", "int", 1) == 5
    for text, kind, lo, hi, want in (("0", "int", 1, 9, "must be an integer in [1, 9], got 0"),
                                     ("x", "int", 1, 9, "expected an integer, got 'x'"),
                                     ("nan", "float", 0.0, 1.0, "must be a finite number in [0, 1], got nan"),
                                     ("y", "float", 0.0, 1.0, "expected a number, got 'y'")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            util.parse_in(text, kind, lo, hi)
        assert str(e.value) == want


def test_sizes_counts_and_hashes(tmp_path):
    assert util.human_size(217 * 2**30) == "217.00 GiB" and util.human_size(5 * 2**30, gib_decimals=1) == "5.0 GiB"
    assert util.human_size(int(93.8 * 2**20)) == "93.8 MiB" and util.human_size(1536) == "1.5 KiB"
    assert util.human_size(512) == "512 B"
    assert util.counted(1, "token") == "1 token" and util.counted(2, "entry", "entries") == "2 entries"
    import hashlib

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * (util._HASH_CHUNK + 3))
    b.write_bytes(b"yz")
    assert util.sha256_file(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    assert util.sha256_file(a, b) == hashlib.sha256(a.read_bytes() + b"yz").hexdigest()


def test_one_helper_of_each():
    """The helpers live once, in tensorfold.util, and the modules that use them import it."""
    import importlib

    from tensorfold import chat_template, engine, info, quantize, tokenizer

    pull = importlib.import_module("tensorfold.pull")  # `tensorfold.pull` the attribute is the function
    pytest.importorskip("fastapi")
    from tensorfold import server

    for mod in (engine, chat_template, tokenizer, server):
        assert mod._is_int is util.is_int, mod.__name__
    assert info.human_size is util.human_size and cli.human_size is util.human_size
    assert info._n is util.counted and cli._n is util.counted
    assert pull._sha256_file is util.sha256_file and quantize.sha256_file is util.sha256_file
    assert engine.ArgumentTypeError is util.ArgumentTypeError


def test_tokenizer_stays_free_of_the_native_core():
    code = ("import sys, importlib.util as u; sys.path.insert(0, %r); import types; "
            "pkg = types.ModuleType('tensorfold'); pkg.__path__ = [%r]; sys.modules['tensorfold'] = pkg; "
            "import tensorfold.tokenizer; print(any('_core' in m for m in sys.modules))")
    import os

    import tensorfold

    root = os.path.dirname(tensorfold.__file__)
    r = subprocess.run([sys.executable, "-c", code % (os.path.dirname(root), root)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
