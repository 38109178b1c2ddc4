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
