"""`tensorfold serve`: the OpenAI-compatible HTTP server, checked with the official `openai`
client (and httpx where the client hides what is tested: disconnects, raw bodies, probes)
against a server on the real SmolLM2 model, in a thread of this process so the tests can
look at the engine (KV blocks, active sequences) behind it."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import tensorfold  # noqa: E402
from tensorfold.server import ServerConfig, create_app, guarded_http_protocol  # noqa: E402

KEY = "test-key-123"
MODEL = "smollm2"
CONTEXT = 512
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


class Running:
    """A uvicorn server on a free port in a background thread."""

    def __init__(self, app, engine=None):
        import uvicorn

        self.app, self.engine = app, engine
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # the connection handling `tensorfold serve` uses (TCP_NODELAY, header timeout, cap)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=guarded_http_protocol(60, 1024)))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    @property
    def state(self):
        return self.app.state  # the server state (create_app returns the guard around FastAPI)

    @property
    def sched(self):
        return self.state.sched

    def client(self, key: str = KEY, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=kw.pop("timeout", 120),
                             **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = tensorfold.Engine(smollm2_path, threads=2, context=CONTEXT)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(ServerConfig(model_name=MODEL, api_key=KEY, max_body_bytes=2**20), engine=engine)
    srv = Running(app, engine)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def idle(engine, server, initial_free: int | None = None, timeout: float = 30) -> dict:
    """Waits until the engine holds no sequence (and all KV tokens are free again)."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine.stats()
        free_ok = initial_free is None or st["free_kv_tokens"] == initial_free
        if st["active_requests"] == 0 and server.sched.n_running == 0 and free_ok:
            return st
        assert time.monotonic() < deadline, f"the engine did not go idle: {st}"
        time.sleep(0.05)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def greedy_chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", MSGS), temperature=0,
                                          max_tokens=kw.pop("max_tokens", 24), **kw)


# -- the happy path ----------------------------------------------------------------------
def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


def test_chat_completion_and_usage(client, engine):
    r = greedy_chat(client)
    assert r.object == "chat.completion" and r.model == MODEL
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    # prompt tokens: the engine's tokenization of the chat template's rendering
    expected = engine.tokenize(engine.apply_chat_template(MSGS), add_special=False)
    assert r.usage.prompt_tokens == len(expected)
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if ch.finish_reason == "length":
        assert r.usage.completion_tokens == 24
    # the same as the Python API
    ref = engine_generate(engine, messages=MSGS, max_tokens=24)
    assert ch.message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)


def engine_generate(engine, **kw):
    """Engine.generate on the served engine: the scheduler gives it back meanwhile."""
    srv_sched = engine._owner
    engine._owner = None
    try:
        with engine._lock:  # the scheduler thread waits for the lock before its next step
            return engine.generate(temperature=0, **kw)
    finally:
        engine._owner = srv_sched


def test_stream_assembles_to_the_non_streamed_text(client):
    full = greedy_chat(client, max_tokens=32)
    chunks = list(greedy_chat(client, max_tokens=32, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_completions_text_token_ids_and_stream(client, engine):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.prompt_tokens == len(engine.tokenize(prompt))
    # token ids are used verbatim
    r2 = client.completions.create(model=MODEL, prompt=engine.tokenize(prompt), max_tokens=16, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text
    assert parts[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # the legacy default is 16 tokens
    r3 = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r3.usage.completion_tokens == 16 and r3.choices[0].finish_reason == "length"


def test_penalties_through_the_openai_client(client, engine):
    """presence_penalty / frequency_penalty from the official client: the same tokens as the
    Python API with the same penalties, and different from none (they are applied)."""
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=32, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=1.0)
    ref = engine_generate(engine, messages=MSGS, max_tokens=32, presence_penalty=1.5, frequency_penalty=1.0)
    plain = engine_generate(engine, messages=MSGS, max_tokens=32)
    assert r.choices[0].message.content == ref.text != plain.text


def test_stop_strings(client):
    full = greedy_chat(client, max_tokens=40).choices[0].message.content
    words = [w for w in re.findall(r"[A-Za-z]{3,}", full)]
    assert len(words) >= 3, full
    stop = words[2]
    expected = full[: full.index(stop)]
    r = greedy_chat(client, max_tokens=40, stop=[stop, "zzzzzz-never"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = list(greedy_chat(client, max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=1.0,
                                              seed=seed).choices[0].message.content

    a = sample(1234)
    assert sample(1234) == a
    assert any(sample(s) != a for s in (1, 2, 3))


# -- logprobs ----------------------------------------------------------------------------
def logprobs_supported(server) -> bool:
    return server.sched.supports_logprobs


def check_logprobs(client) -> None:
    r = greedy_chat(client, logprobs=True, top_logprobs=3, max_tokens=12)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.token == e.top_logprobs[0].token  # greedy: the sampled token is the most likely
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    assert "".join(e.token for e in content) == r.choices[0].message.content
    # only the sampled token's logprob
    r0 = greedy_chat(client, logprobs=True, max_tokens=4)
    assert r0.choices[0].logprobs.content and all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    # without logprobs: none
    assert greedy_chat(client, max_tokens=2).choices[0].logprobs is None
    # streamed: the same entries
    chunks = list(greedy_chat(client, logprobs=True, top_logprobs=3, max_tokens=12, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    # legacy completions: logprobs=k
    rc = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0,
                                   logprobs=2)
    lp = rc.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) >= 1
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == rc.choices[0].text


def test_logprobs(server, client):
    if not logprobs_supported(server):
        pytest.skip("logprobs not supported by this build (its _core.capabilities() does not list them)")
    check_logprobs(client)


class LogprobCore:
    """A native core as the logprobs-capable build presents it (add_request(..., top_logprobs)
    and a 5th element in step()'s tuples; the build's capabilities() says "logprobs"), with
    made-up values around the real tokens: checks the server's plumbing and formatting on any
    build."""

    def __init__(self, core):
        self._c = core
        self._k: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self._c, name)

    def add_request(self, *args, top_logprobs: int = -1):
        """add_request(prompt, ..., top_logprobs: int = -1)"""
        rid = self._c.add_request(*args)
        self._k[rid] = top_logprobs
        return rid

    def step(self):
        out = []
        for rid, tok, finished, why in self._c.step():
            k = self._k.get(rid, -1)
            lp = None
            if k >= 0 and tok >= 0:
                lp = (-0.25, [] if k == 0 else [(tok, -0.25)] + [((tok + i) % 1000, -1.0 - i) for i in range(1, k)])
            out.append((rid, tok, finished, why, lp))
        return out


def test_logprobs_plumbing_with_a_core_that_reports_them(smollm2_path, monkeypatch):
    from tensorfold import _core

    caps = getattr(_core, "capabilities", dict)
    monkeypatch.setattr(_core, "capabilities", lambda: {**caps(), "logprobs": True}, raising=False)
    eng = tensorfold.Engine(smollm2_path, threads=1, context=256)
    eng._core = LogprobCore(eng._core)
    srv = Running(create_app(ServerConfig(model_name=MODEL), engine=eng), eng)
    try:
        assert srv.sched.supports_logprobs
        check_logprobs(srv.client())
        with pytest.raises(openai.BadRequestError) as e:
            greedy_chat(srv.client(), logprobs=True, top_logprobs=21)
        assert e.value.body["param"] == "top_logprobs"
    finally:
        srv.stop()
        eng.close()


def test_logprobs_unsupported_is_a_clear_400(server, client):
    if logprobs_supported(server):
        pytest.skip("this build supports logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        greedy_chat(client, logprobs=True, max_tokens=4)
    assert "logprobs not supported by this build" in e.value.body["message"]


# -- errors ------------------------------------------------------------------------------
def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS)
    assert e.value.status_code == 404
    assert e.value.body == {"message": e.value.body["message"], "type": "invalid_request_error", "param": "model",
                            "code": "model_not_found"}


def test_prompt_longer_than_the_context_is_400(client, server, engine):
    long = "hello " * CONTEXT
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}])
    assert e.value.body["code"] == "context_length_exceeded" and "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long)
    assert e.value.body["code"] == "context_length_exceeded"
    # prompt + max_tokens beyond the context
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=CONTEXT)
    assert e.value.body["param"] == "max_tokens"
    assert engine.stats()["active_requests"] == 0


@pytest.mark.parametrize("kw, param", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=2), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(stop=[1, 2]), "stop"),
    (dict(seed="x"), "seed"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={"42": 5}), "logit_bias"),
    (dict(top_logprobs=3), "top_logprobs"),  # without logprobs=True
    (dict(stream_options={"include_usage": True}), "stream_options"),  # without stream
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), "messages"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"top_k": 2.0}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"ignore_eos": "yes"}), "ignore_eos"),
    (dict(extra_body={"temperature": True}), "temperature"),
    (dict(extra_body={"seed": 1.5}), "seed"),
    (dict(max_completion_tokens=0), "max_completion_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_parameters_are_400(client, kw, param):
    kw = dict(dict(model=MODEL, messages=MSGS, max_tokens=4), **kw)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == param and body["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_sampling_errors_state_the_range(server, path):
    """A bad sampling value is refused with the request spec's words: the parameter, its range
    as the HTTP API takes it, and what special values mean."""
    base = {"model": MODEL, "messages": MSGS} if "chat" in path else {"model": MODEL, "prompt": "Hi"}
    h = {"Authorization": f"Bearer {KEY}"}
    for extra, param, message in (
            ({"top_p": 0}, "top_p", "top_p must be a finite number in (0, 1] (1 = off), got 0"),
            ({"temperature": 2.5}, "temperature",
             "temperature must be a finite number in [0, 2] (0 = greedy), got 2.5"),
            ({"top_k": -2}, "top_k", "top_k must be an integer in [-1, 2147483647] (0 or -1 = off), got -2"),
            ({"seed": "7"}, "seed", "seed must be an integer (used modulo 2**64) or null, got '7'")):
        r = httpx.post(server.url + path, json={**base, **extra}, headers=h)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": "invalid_value"}


def test_absent_sampling_parameters_take_openais_defaults(server, client):
    """A request that leaves the sampling parameters out gets the OpenAI API's meaning
    (temperature 1, nothing filtering), passed on explicitly, not the Python API's defaults;
    top_k -1 (vLLM's "off") is 0."""
    sched = server.sched
    seen = []
    real = sched.submit

    def spy(ids, sink, **kw):
        seen.append(kw)
        return real(ids, sink, **kw)

    sched.submit = spy
    try:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"top_k": -1, "min_p": 0.1})
    finally:
        del sched.submit
    neutral = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, ignore_eos=False)
    assert {k: seen[0][k] for k in neutral} == neutral
    assert {k: seen[1][k] for k in neutral} == dict(neutral, min_p=0.1)


def test_wrong_or_missing_api_key_is_401(server):
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            server.client(key=key).chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    # the probes are open
    assert httpx.get(server.url + "/health").status_code == 200


def test_raw_http_errors(server):
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(server.url + "/v1/chat/completions", json=[1, 2], headers=h)
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSGS}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2**20 + 10)}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=big, headers=h)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit holds while reading
        for _ in range(20):
            yield b"x" * 2**17

    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=h)
    assert r.status_code == 413
    r = httpx.get(server.url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions", headers=h)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3, 4]]}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [10**9]}, headers=h)
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


# -- cancellation ------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_sequence(server, engine):
    free0 = idle(engine, server)["free_kv_tokens"]
    aborted0 = metric(httpx.get(server.url + "/metrics").text, "tensorfold_requests_total", '{finish_reason="abort"}')
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            n = 0
            lines = r.iter_lines()  # kept: a collected iterator closes the connection
            for line in lines:
                if line.startswith("data: "):
                    n += 1
                if n >= 4:
                    break
            assert engine.stats()["active_requests"] == 1
        # leaving the block closes the connection mid-stream
    st = idle(engine, server, free0)
    assert st["free_kv_tokens"] == free0
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "tensorfold_requests_total", '{finish_reason="abort"}') == aborted0 + 1


def test_disconnect_while_waiting_for_a_non_streamed_reply(server, engine):
    free0 = idle(engine, server)["free_kv_tokens"]
    gen0 = engine.stats()["generated_tokens"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=1.0)
    st = idle(engine, server, free0)
    assert st["generated_tokens"] - gen0 < 450  # stopped early, not run to the end


def test_step_failure_fails_the_request_with_500_and_the_server_goes_on(server, engine, client):
    idle(engine, server)

    class Failing:
        def __init__(self, core):
            self._c = core

        def __getattr__(self, name):
            return getattr(self._c, name)

        def step(self):
            raise RuntimeError("simulated engine failure")

    real = engine._core
    engine._core = Failing(real)
    try:
        with pytest.raises(openai.InternalServerError) as e:
            greedy_chat(client, max_tokens=4)
        assert e.value.status_code == 500 and "simulated engine failure" in e.value.body["message"]
        assert e.value.body["type"] == "server_error"
        with pytest.raises(openai.APIError, match="simulated engine failure"):
            list(greedy_chat(client, max_tokens=4, stream=True))
    finally:
        engine._core = real
    assert server.sched.alive
    assert greedy_chat(client, max_tokens=4).choices[0].message.content
    idle(engine, server)


# -- probes ------------------------------------------------------------------------------
def test_health_ready_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    before = httpx.get(server.url + "/metrics").text
    r = greedy_chat(client, max_tokens=8, stream=True)
    list(r)
    m = httpx.get(server.url + "/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for name in ("tensorfold_time_to_first_token_seconds_bucket", "tensorfold_inter_token_latency_seconds_bucket",
                 "tensorfold_queue_depth", "tensorfold_running_requests", "tensorfold_kv_blocks_used",
                 "tensorfold_kv_blocks_free", "tensorfold_prefix_cache_hits_total",
                 "tensorfold_generation_tokens_total", "tensorfold_prompt_tokens_total",
                 "tensorfold_http_requests_total"):
        assert re.search(rf"^{name}\b", text, re.M), name
    assert metric(text, "tensorfold_generation_tokens_total") >= metric(before, "tensorfold_generation_tokens_total") + 1
    assert metric(text, "tensorfold_time_to_first_token_seconds_count") > \
        metric(before, "tensorfold_time_to_first_token_seconds_count")
    assert metric(text, "tensorfold_http_requests_total", '{endpoint="/v1/chat/completions",status="200"}') >= 1
    assert metric(text, "tensorfold_kv_blocks_used") + metric(text, "tensorfold_kv_blocks_free") == \
        metric(text, "tensorfold_kv_blocks_total") > 0


def test_ready_is_503_until_loaded_and_says_when_loading_failed():
    release = threading.Event()
    failures = []

    def loader():
        release.wait(30)
        raise ValueError("no such model file")

    app = create_app(ServerConfig(model_name="x"), loader=loader, on_load_error=failures.append)
    srv = Running(app)
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        with pytest.raises(openai.APIStatusError) as e:
            srv.client().chat.completions.create(model="x", messages=MSGS)
        assert e.value.status_code == 503 and e.value.body["code"] == "model_loading"
        release.set()
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.get(srv.url + "/ready")
        assert r.status_code == 503 and "no such model file" in r.json()["error"]
        assert "tensorfold_model_ready 0.0" in httpx.get(srv.url + "/metrics").text
    finally:
        release.set()
        srv.stop()


def test_queue_full_is_429(smollm2_path):
    eng = tensorfold.Engine(smollm2_path, threads=1, context=256)
    app = create_app(ServerConfig(model_name=MODEL, max_running=1, max_queue=1), engine=eng)
    srv = Running(app, eng)
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", srv.url + "/v1/chat/completions", json=body) as r1:
                lines = r1.iter_lines()  # kept: a collected iterator closes the connection
                next(lines)
                deadline = time.monotonic() + 10
                while srv.sched.n_running != 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                with h.stream("POST", srv.url + "/v1/chat/completions", json=body) as r2:  # waits
                    assert r2.status_code == 200
                    while srv.sched.queue_depth != 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.01)
                    with pytest.raises(openai.RateLimitError) as e:
                        srv.client().chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
                    assert e.value.body["code"] == "queue_full"
                    text = httpx.get(srv.url + "/metrics").text
                    assert metric(text, "tensorfold_queue_depth") == 1
        deadline = time.monotonic() + 30
        while eng.stats()["active_requests"] or srv.sched.queue_depth or srv.sched.n_running:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert eng.stats()["free_kv_tokens"] == eng.stats()["kv_tokens"]
    finally:
        srv.stop()
        eng.close()


def test_scheduler_queue_cancel_and_close(smollm2_path):
    """The scheduler without HTTP: a bounded queue, cancelling a waiting request, close()
    ending what is left with SchedulerClosed and giving the engine back."""
    import queue

    from tensorfold.scheduler import QueueFull, Scheduler, SchedulerClosed

    eng = tensorfold.Engine(smollm2_path, threads=1, context=256)
    sched = Scheduler(eng, max_running=1, max_queue=1)
    try:
        with pytest.raises(RuntimeError, match="scheduler"):
            eng.generate("hi", max_tokens=2)
        ids = eng.tokenize("Once upon a time")
        q1, q2 = queue.SimpleQueue(), queue.SimpleQueue()
        r1 = sched.submit(ids, q1.put, max_tokens=200, temperature=0, ignore_eos=True)
        assert q1.get(timeout=30).tokens  # running
        r2 = sched.submit(ids, q2.put, max_tokens=5)
        assert sched.queue_depth == 1
        with pytest.raises(QueueFull):
            sched.submit(ids, print, max_tokens=5)
        sched.cancel(r2)
        d = q2.get(timeout=5)
        assert d.finish_reason == "abort" and r2.done and sched.queue_depth == 0
        with pytest.raises(ValueError, match="temperature"):
            sched.submit(ids, print, temperature=-1)
        with pytest.raises(ValueError, match="context"):
            sched.submit(list(range(300)), print)
        sched.close()
        while True:
            d = q1.get(timeout=30)
            if d.final:
                break
        assert isinstance(d.error, SchedulerClosed) and r1.done
        with pytest.raises(SchedulerClosed):
            sched.submit(ids, print)
        st = eng.stats()
        assert st["active_requests"] == 0 and st["free_kv_tokens"] == st["kv_tokens"]
        assert eng.generate("hi", max_tokens=2, temperature=0, ignore_eos=True).usage["completion_tokens"] == 2
        # the blocking stream helper
        sched2 = Scheduler(eng)
        deltas = list(sched2.stream(ids, max_tokens=6, temperature=0, ignore_eos=True))
        assert deltas[-1].finish_reason == "length" and sum(len(d.tokens) for d in deltas) == 6
        sched2.close()
        ref = eng.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
        assert "".join(d.text for d in deltas) == ref.text
    finally:
        sched.close()
        eng.close()


# -- load --------------------------------------------------------------------------------
def test_load_16_clients_x_8_requests(server, client, engine):
    """16 concurrent clients x 8 requests (chat and completions, streamed and not): no errors,
    every response complete, and the engine idle with all KV blocks free afterwards. Prompts
    are short and max_tokens small so that it stays fast on two cores."""
    free0 = idle(engine, server)["free_kv_tokens"]
    words = ["Paris", "water", "seven", "green", "music", "river", "apple", "cloud"]

    def one(i: int, j: int):
        w = words[(i + j) % len(words)]
        kind = j % 4
        if kind < 2:
            msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": w}]
            if kind == 0:
                r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.7)
                return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
            parts = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0.7,
                                                        stream=True, stream_options={"include_usage": True}))
            text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        else:
            if kind == 2:
                r = client.completions.create(model=MODEL, prompt=f"The {w}", max_tokens=8, temperature=0.7)
                return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
            parts = list(client.completions.create(model=MODEL, prompt=f"The {w}", max_tokens=8, temperature=0.7,
                                                   stream=True, stream_options={"include_usage": True}))
            text = "".join(p.choices[0].text for p in parts if p.choices)
        reasons = [p.choices[0].finish_reason for p in parts if p.choices and p.choices[0].finish_reason]
        assert len(reasons) == 1 and parts[-1].usage is not None
        return text, reasons[0], parts[-1].usage.completion_tokens

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as ex:
        futures = [ex.submit(lambda i=i: [one(i, j) for j in range(8)]) for i in range(16)]
        results = [r for f in futures for r in f.result()]
    elapsed = time.monotonic() - t0
    assert len(results) == 128
    for text, reason, n in results:
        assert reason in ("stop", "length")
        assert 1 <= n <= 8 and (reason != "length" or n == 8)
        assert reason == "stop" or text
    idle(engine, server, free0)
    print(f"128 requests in {elapsed:.1f}s")


# -- the command ---------------------------------------------------------------------------
def test_serve_help():
    r = subprocess.run([sys.executable, "-m", "tensorfold", "serve", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    for opt in ("--host", "--port", "--api-key", "TENSORFOLD_API_KEY", "--max-queue", "--max-running",
                "--max-body-bytes", "--max-prompt-tokens", "--tp", "--peer", "--rails", "/v1/chat/completions",
                "/metrics", "429"):
        assert opt in r.stdout, opt


def test_serve_command(smollm2_path):
    env = dict(os.environ, TENSORFOLD_API_KEY="env-key")
    p = subprocess.Popen([sys.executable, "-m", "tensorfold", "serve", smollm2_path, "--port", "0", "-t", "1",
                          "-c", "256", "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        url = f"http://127.0.0.1:{m.group(1)}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.1)
        name = os.path.basename(smollm2_path)[: -len(".gguf")]
        c = openai.OpenAI(base_url=url + "/v1", api_key="env-key", max_retries=0)
        assert [x.id for x in c.models.list().data] == [name]
        r = c.completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        err = p.stderr.read()
    assert rc == 0, err
    assert "Traceback" not in err, err


def test_serve_command_reports_a_model_that_fails_to_load(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    r = subprocess.run([sys.executable, "-m", "tensorfold", "serve", str(bad), "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "tensorfold: error:" in r.stderr and "Traceback" not in r.stderr


def test_import_tensorfold_does_not_import_the_web_stack():
    code = "import sys, tensorfold; print(any(m in sys.modules for m in ('fastapi', 'uvicorn', 'prometheus_client')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
