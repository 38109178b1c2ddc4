"""Chat templates: our renders vs llama-cpp-python's Jinja formatter (fixtures), sandboxing,
message validation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorfold.chat_template import DEFAULT_CHATML_TEMPLATE, render_chat, validate_messages

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json"


@pytest.fixture(scope="module")
def fx() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_renders_match_llama_cpp_python(fx):
    ct = fx["chat_template"]
    assert len(ct["conversations"]) >= 3
    for conv in ct["conversations"]:
        got = render_chat(
            ct["template"], conv["messages"],
            add_generation_prompt=conv["add_generation_prompt"],
            bos_token=ct["bos_token"], eos_token=ct["eos_token"],
        )
        assert got == conv["rendered"]


def test_greedy_chat_prompts_match(fx):
    ct = fx["chat_template"]
    chats = [g for g in fx["greedy"] if g["kind"] == "chat"]
    assert chats
    for g in chats:
        got = render_chat(ct["template"], g["messages"], bos_token=ct["bos_token"],
                          eos_token=ct["eos_token"])
        assert got == g["prompt"]


def test_fallback_chatml():
    msgs = [{"role": "user", "content": "hi"}]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(None, msgs) == expected
    assert render_chat("", msgs) == expected
    assert render_chat(DEFAULT_CHATML_TEMPLATE, msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_trim_and_lstrip_blocks():
    tpl = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    assert render_chat(tpl, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a]\n[b]\n"


def test_helpers_and_extras():
    tpl = (
        "{{ bos_token }}{{ strftime_now('%Y') | length }}|{{ messages[0] | tojson }}|"
        "{{ tools | length if tools else 0 }}|{{ custom }}{{ eos_token }}"
    )
    out = render_chat(tpl, [{"role": "user", "content": "é"}], bos_token="<s>", eos_token="</s>",
                      tools=[{"type": "function"}], custom="X")
    assert out == '<s>4|{"role": "user", "content": "é"}|1|X</s>'


def test_loopcontrols_and_generation_tag():
    tpl = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert render_chat(tpl, msgs) == "U"


def test_raise_exception_becomes_value_error():
    tpl = "{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    with pytest.raises(ValueError, match="need a system message"):
        render_chat(tpl, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "tpl",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__base__ }}{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ messages.append({'role': 'x', 'content': 'y'}) }}",  # immutable sandbox
        "{{ (messages[0]).update({'role': 'z'}) }}",
    ],
)
def test_sandbox_blocks_escapes(tpl):
    with pytest.raises(ValueError):
        render_chat(tpl, [{"role": "user", "content": "x"}])


def test_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="syntax"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat("{{ messages[5].content.upper() }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat("{{ 1 / 0 }}", [{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    "messages,match",
    [
        ("hello", "list"),
        ([["user", "hi"]], "dict"),
        ([{"content": "hi"}], "role"),
        ([{"role": 3, "content": "hi"}], "role"),
        ([{"role": "", "content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": "user", "content": None}], "content"),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(None, messages)


def test_valid_messages():
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    assert validate_messages(msgs) == msgs
    assert validate_messages([]) == []


# --------------------------------------------------------------------------------------------
# Limits: hostile templates are refused quickly, real ones render exactly as plain jinja2 does
# --------------------------------------------------------------------------------------------

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402

import tensorfold.chat_template as chat_template  # noqa: E402

MSGS = [{"role": "user", "content": "hi"}]

# The three from the issue, then the other ways to build a large value in one step.
HOSTILE = {
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "str_times_huge": "{{ 'x' * 3000000000 }}",
    "percent_width": "{{ '%999999999s' % 'a' }}",
    "percent_star": "{{ '%*s' % (999999999, 'a') }}",
    "percent_precision": "{{ '%.999999999f' % 1.0 }}",
    "format_filter": "{{ '%999999999s'|format('a') }}",
    "str_format_width": "{{ '{:999999999}'.format(1) }}",
    "str_format_nested_width": "{{ '{:{w}}'.format(1, w=999999999) }}",
    "center_filter": "{{ 'x'|center(999999999) }}",
    "center_method": "{{ 'x'.center(999999999) }}",
    "to_bytes": "{{ (1).to_bytes(999999999, 'big') }}",
    "power": "{{ 10 ** 1000000000 }}",
    "concat_doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "plus_doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
    "shared_lists": "{% set L = range(100000)|list %}{% set L2 = [L,L,L,L,L,L,L,L,L,L] %}{{ [L2,L2,L2,L2,L2,L2,L2,L2,L2,L2] }}",
    "replace_blowup": "{% set s = 'x' * 100000 %}{{ s.replace('x', s) }}",
    "join_blowup": "{% set s = 'x' * 100000 %}{{ range(100000)|join(s) }}",
    "indent_blowup": "{{ ('\n' * 1000000)|indent(1000000, blank=True) }}",
    "batch_fill": "{{ [1]|batch(999999999, 'x')|list }}",
    "macro_text": "{% macro m() %}{% for i in range(100000) %}" + "A" * 10000 + "{% endfor %}{% endmacro %}{{ m() }}",
    "huge_output": "{% for i in range(100000) %}{{ 'x' * 4000 }}{% endfor %}",
    "translate": "{{ ('a' * 1000).translate({97: 'x' * 1000000}) }}",
    "sum_of_lists": "{{ ([[0] * 2000] * 2000)|sum(start=[]) }}",
    "string_loops": "{% set s = 'x' * 1000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "macro_fanout": "{% macro f(d) %}{% if d > 0 %}{{ f(d - 1) }}{{ f(d - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "recursive_loop": "{% set L = range(1000)|list %}{% for x in L recursive %}{% if loop.depth < 5 %}{{ loop(L) }}{% endif %}{% endfor %}",
}


def test_hostile_templates_are_refused_quickly_and_small():
    """Every hostile template, in two child processes: ValueError naming the chat template
    within a few seconds, and no template raises the process's peak RSS by more than 300 MB
    (they used to take gigabytes). An address-space limit keeps a regression from hurting the
    machine."""
    code = textwrap.dedent("""
        import json, os, resource, sys, time
        if "asan" not in os.environ.get("LD_PRELOAD", ""):  # ASan needs its address space
            resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        import tensorfold.chat_template as ct
        ct.MAX_RENDER_SECONDS = 3.0
        cases = json.loads(sys.stdin.read())
        for name, tpl in cases:
            base = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
            t = time.monotonic()
            try:
                ct.render_chat(tpl, [{"role": "user", "content": "hi"}])
                out = ("rendered", "")
            except BaseException as e:
                out = (type(e).__name__ + ("/ValueError" if isinstance(e, ValueError) else ""), str(e))
            print(json.dumps({"name": name, "result": out, "seconds": time.monotonic() - t,
                              "growth": int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) - base}),
                  flush=True)
    """)
    import json

    items = list(HOSTILE.items())
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(json.dumps(items[i::2]), timeout=300) for i, p in enumerate(procs)]
    seen = set()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        for line in out.splitlines():
            r = json.loads(line)
            name, (kind, msg) = r["name"], r["result"]
            seen.add(name)
            assert kind == "TemplateError/ValueError", (name, kind, msg)
            assert msg.startswith("chat template"), (name, msg)
            assert r["seconds"] < 4.0, (name, r["seconds"], msg)
            assert r["growth"] * 1024 < 300 << 20, (name, r["growth"], msg)
    assert seen == set(HOSTILE)


@pytest.mark.parametrize("name", ["nested_range", "str_times_huge", "percent_width"])
def test_issue_templates_in_process(name, monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 3.0)
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"^chat template: ") as ei:
        render_chat(HOSTILE[name], MSGS)
    assert time.monotonic() - t < 4.0
    want = {"nested_range": "too much work", "str_times_huge": "'*' (repetition) would build about 3000000000",
            "percent_width": "'%' formatting would build about 1000000"}[name]
    assert want in str(ei.value)


def test_time_limit(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_SECONDS", 0.3)
    monkeypatch.setattr(chat_template, "MAX_STEPS", 10**12)
    t = time.monotonic()
    with pytest.raises(ValueError, match="longer than 0.3 s"):
        render_chat(HOSTILE["nested_range"], MSGS)
    assert time.monotonic() - t < 1.5


def test_output_limit_counts_the_rendered_prompt(monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_OUTPUT_CHARS", 1000)
    ok = [{"role": "user", "content": "x" * 900}]
    assert len(render_chat(None, ok)) < 1000
    with pytest.raises(ValueError, match="rendered prompt is longer than 1000 characters"):
        render_chat(None, [{"role": "user", "content": "x" * 1000}])


def test_template_must_be_a_string():
    with pytest.raises(ValueError, match="must be a string, got int"):
        render_chat(5, MSGS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a string, got list"):
        render_chat([1, 2], MSGS)  # type: ignore[arg-type]


# Real-world style templates: every feature they use must render exactly as jinja2 itself
# renders it (the oracle: a plain ImmutableSandboxedEnvironment with the same options).
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}{% if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.function.name }}{{- '", "arguments": ' }}{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif not (message.role == 'system' and tools) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
{{- '' if ns.last_user >= 0 else raise_exception('no user message') }}"""
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
FEATURES = (
    "{% macro fmt(m, i) -%}[{{ '%03d' % i }}|{{ '{:>8}'.format(m.role) }}|{{ m.content|upper|replace('A', 'a') }}]"
    "{%- endmacro %}{% for m in messages if m.role != 'tool' %}{{ fmt(m, loop.index) }}"
    "{{ ', ' if not loop.last }}{% endfor %}\n{{ messages|map(attribute='role')|join('/') }}|"
    "{{ messages|selectattr('role', 'equalto', 'user')|list|length }}|{{ (messages|first).content[:3] }}|"
    "{{ range(3)|list }}|{{ 2 ** 10 }}|{{ 7 // 2 }}|{{ 'ab' * 3 }}|{{ 'x' ~ 1 ~ none }}|"
    "{{ messages[-1].content.split(' ')|reverse|join(' ') }}|{{ '%s-%d'|format('a', 5) }}|"
    "{{ 'line1\nline2'|indent(2, first=True) }}|{{ 'title'|center(11) }}|{{ {'b': 1, 'a': 2}|dictsort }}|"
    "{% for k, v in {'k': [1, 2]}.items() %}{{ k }}={{ v|sum }}{% endfor %}|{{ 'é'|tojson }}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? A question."},
    {"role": "assistant", "content": "  4  "},
    {"role": "user", "content": "And 3+3, please answer"},
]


def _plain_jinja(template, **ctx):
    import json as _json

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: _json.dumps(x, ensure_ascii=False, indent=indent)

    def raise_exception(msg):
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(**ctx)


@pytest.mark.parametrize("name, template", [("chatml", DEFAULT_CHATML_TEMPLATE), ("llama3", LLAMA3),
                                            ("qwen_tools", QWEN_TOOLS), ("mistral", MISTRAL),
                                            ("features", FEATURES)])
def test_real_templates_render_as_plain_jinja(name, template):
    msgs = CONVERSATION[1:] if name == "mistral" else CONVERSATION
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int"}}}]
    for extra in ({}, {"tools": tools}):
        ctx = dict(messages=msgs, add_generation_prompt=True, bos_token="<s>", eos_token="</s>",
                   tools=extra.get("tools"))
        expected = _plain_jinja(template, **ctx)
        got = render_chat(template, msgs, bos_token="<s>", eos_token="</s>", tools=extra.get("tools"))
        assert got == expected
        assert len(got) > 20


def test_long_real_conversation_is_fast(fx):
    ct = fx["chat_template"]
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello world " * 50}
            for i in range(2000)]
    t = time.monotonic()
    out = render_chat(ct["template"], msgs, bos_token=ct["bos_token"], eos_token=ct["eos_token"])
    assert time.monotonic() - t < 2.0
    assert out == _plain_jinja(ct["template"], messages=msgs, add_generation_prompt=True,
                               bos_token=ct["bos_token"], eos_token=ct["eos_token"], tools=None)
