"""Render chat conversations with a model's Jinja chat template, inside jinja2's sandbox.

The environment follows what Hugging Face ``transformers`` (and llama-cpp-python) use for chat
templates: ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension, a
pass-through ``{% generation %}`` tag, ``tojson`` that keeps non-ASCII text, and the helpers
``raise_exception`` and ``strftime_now``. Templates run in an ``ImmutableSandboxedEnvironment``
so a hostile GGUF cannot reach Python internals.

This module has no dependency on the native core.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Mapping, Sequence

__all__ = ["render_chat", "validate_messages", "DEFAULT_CHATML_TEMPLATE", "TemplateError"]

# Used when a GGUF carries no tokenizer.chat_template.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MAX_TEMPLATE_CHARS = 1 << 20


class TemplateError(ValueError):
    """A chat template failed to compile or render (or raised on purpose)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised an error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        autoescape=False,
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2

    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template could not be compiled: {e}") from e


def validate_messages(messages: Any) -> list[dict]:
    """Check that ``messages`` is a list of dicts with a str ``role`` and str ``content``.

    An assistant message carrying ``tool_calls`` may have ``content`` None. Returns the list.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty str, got {role!r}")
        if "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        content = m["content"]
        if not isinstance(content, str):
            if not (content is None and m.get("tool_calls")):
                raise ValueError(
                    f"messages[{i}]['content'] must be a str, got {type(content).__name__}"
                )
        out.append(dict(m))
    return out


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Any = None,
    **extra: Any,
) -> str:
    """Render ``messages`` with the Jinja chat ``template`` (ChatML when None or empty).

    Raises ValueError (``TemplateError``) when the template is broken, raises on purpose or
    tries something the sandbox forbids, and ValueError for malformed messages.
    """
    import jinja2
    from jinja2.exceptions import SecurityError

    if not template:
        template = DEFAULT_CHATML_TEMPLATE
    if not isinstance(template, str):
        raise TypeError(f"template must be str, got {type(template).__name__}")
    if len(template) > _MAX_TEMPLATE_CHARS:
        raise TemplateError(f"chat template is too long ({len(template)} characters)")
    msgs = validate_messages(messages)
    compiled = _compile(template)
    ctx = dict(extra)
    ctx.update(
        messages=msgs,
        add_generation_prompt=bool(add_generation_prompt),
        bos_token=bos_token,
        eos_token=eos_token,
        tools=tools,  # passed even when None, as transformers and llama-cpp-python do
    )
    try:
        return compiled.render(**ctx)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template tried an operation the sandbox forbids: {e}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {e}") from e
    except (TypeError, KeyError, AttributeError, IndexError, ValueError, ZeroDivisionError) as e:
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
    except RecursionError as e:
        raise TemplateError("chat template recursed too deeply") from e
