"""Render chat conversations with a model's Jinja chat template, inside jinja2's sandbox.

The environment follows what Hugging Face ``transformers`` (and llama-cpp-python) use for chat
templates: ``trim_blocks`` and ``lstrip_blocks`` on, the ``loopcontrols`` extension, a
pass-through ``{% generation %}`` tag, ``tojson`` that keeps non-ASCII text, and the helpers
``raise_exception`` and ``strftime_now``. Templates run in an ``ImmutableSandboxedEnvironment``
so a hostile GGUF cannot reach Python internals.

The sandbox alone does not bound work: ``range(100000)`` loops nest, ``'x' * 3000000000`` and
``'%999999999s' % x`` build gigabytes in one operation. So every render also runs under a
budget (see ``_Budget``): loop iterations, calls and attribute lookups are counted and the
clock checked as they go, operations that can build large values (``*``, ``+``, ``%``, ``**``,
``~``, ``str.format`` widths, width/count arguments of filters and string methods) are checked
before they run, and the output is streamed and cut off at ``MAX_OUTPUT_CHARS``. Going over any
limit raises ``TemplateError`` (a ``ValueError``).

This module has no dependency on the native core.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
from datetime import datetime
from typing import Any, Mapping, Sequence

from .util import is_int as _is_int

__all__ = ["render_chat", "validate_messages", "check_role", "check_roles", "ROLES", "DEFAULT_CHATML_TEMPLATE",
           "TemplateError"]

# The roles a chat message may have (OpenAI's chat API's). "developer" is OpenAI's newer name
# for "system"; templates see it as "system". check_role/check_roles are the one check of
# message roles, used by Engine (messages=...) and the HTTP server alike.
ROLES = ("system", "user", "assistant", "tool", "developer")

# Used when a GGUF carries no tokenizer.chat_template.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_MAX_TEMPLATE_CHARS = 1 << 20

# Render limits. Real chat templates render a conversation in milliseconds with a few thousand
# steps; these bound what a hostile template can cost (module attributes, so a deployment or a
# test can change them).
MAX_RENDER_SECONDS = 5.0        # wall clock for one render
MAX_OUTPUT_CHARS = 4 << 20      # the rendered prompt (~1M tokens, beyond any context here)
MAX_VALUE_CHARS = 4 << 20       # one string/list built by an operation or filter
MAX_PRODUCED_CHARS = 64 << 20   # all text and lists built during one render, together
MAX_STEPS = 4_000_000           # loop iterations + calls + attribute lookups
MAX_INT_BITS = 1 << 16          # integers built by * and **


class TemplateError(ValueError):
    """A chat template failed to compile or render (or raised on purpose)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised an error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    width = len(indent) if isinstance(indent, str) else indent
    if width is not None and not (isinstance(width, int) and 0 <= width <= 64):
        raise TemplateError(f"chat template: tojson indent {indent!r:.40} is out of range (0..64)")
    _check_value(_approx_size(x, MAX_VALUE_CHARS, width or 0), "tojson")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# --------------------------------------------------------------------------------------------
# The budget of the render running in this thread


class _Budget:
    """Work and memory spent by one render. Once a limit is hit it stays hit: every later
    check raises again, so a filter that swallows the first error cannot get past it."""

    __slots__ = ("deadline", "steps", "produced", "_clock", "exceeded")

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.steps = 0
        self.produced = 0
        self._clock = 0
        self.exceeded: str | None = None

    def _fail(self, msg: str):
        self.exceeded = self.exceeded or msg
        raise TemplateError(self.exceeded)

    def tick(self, n: int = 1) -> None:
        if self.exceeded:
            raise TemplateError(self.exceeded)
        self.steps += n
        if self.steps > MAX_STEPS:
            self._fail(f"chat template: too much work (more than {MAX_STEPS} loop iterations, "
                       f"calls and lookups); refusing to render it")
        self._clock += n
        if self._clock >= 256:
            self._clock = 0
            self.check_time()

    def check_time(self) -> None:
        if self.exceeded:
            raise TemplateError(self.exceeded)
        if time.monotonic() > self.deadline:
            self._fail(f"chat template: rendering took longer than {MAX_RENDER_SECONDS:g} s; "
                       f"refusing to render it")

    def produce(self, n: int) -> None:
        if self.exceeded:
            raise TemplateError(self.exceeded)
        self.produced += n
        if self.produced > MAX_PRODUCED_CHARS:
            self._fail(f"chat template: builds more than {MAX_PRODUCED_CHARS} characters of "
                       f"text while rendering; refusing to render it")


_local = threading.local()


def _budget() -> _Budget:
    b = getattr(_local, "budget", None)
    return b if b is not None else _Budget()  # outside render_chat: per-call checks only


def _shallow_size(v: Any) -> int:
    if isinstance(v, (str, bytes, bytearray, list, tuple, dict, set, frozenset)):
        return len(v)
    return 0


def _produced(v: Any) -> Any:
    _budget().produce(_shallow_size(v))
    return v


def _approx_size(x: Any, limit: int, indent: int = 0) -> int:
    """About how many characters str(x) (or JSON with this indent) has; stops counting once
    over ``limit``, so the cost is O(min(size, limit)) even for shared sub-lists."""
    from jinja2.utils import Namespace

    total = 0
    stack = [(x, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (str, bytes, bytearray)):
            total += len(v) + 2
        elif isinstance(v, (list, tuple, set, frozenset, dict, Namespace)):
            if isinstance(v, Namespace):
                v = object.__getattribute__(v, "_Namespace__attrs")
            n = len(v)
            total += 2 + n * (2 + indent * (depth + 1))
            if total > limit:
                return total
            if isinstance(v, dict):
                stack.extend((k, depth + 1) for k in v.keys())
                stack.extend((w, depth + 1) for w in v.values())
            else:
                stack.extend((w, depth + 1) for w in v)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        else:
            total += 16
        if total > limit:
            return total
    return total


def _check_value(size: int, what: str) -> None:
    if size > MAX_VALUE_CHARS:
        raise TemplateError(f"chat template: {what} would build about {size} characters "
                            f"(limit {MAX_VALUE_CHARS}); refusing to render it")


def _check_count(v: Any, what: str, limit: int = MAX_VALUE_CHARS) -> None:
    if _is_int(v) and v > limit:
        raise TemplateError(f"chat template: {what} {v} is too large (limit {limit}); "
                            f"refusing to render it")


# printf-style conversion: %[(name)][flags][width][.precision][length]type
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?([a-zA-Z%])")
# str.format spec: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[a-zA-Z%]?$", re.S)


def _check_printf(fmt: str, args: Any) -> None:
    """'%999999999s' % x: refuse before Python allocates the padding."""
    width = 0
    stars = False
    for m in _PRINTF.finditer(fmt):
        for g in (m.group(1), m.group(2)):
            if g == "*":
                stars = True
            elif g:
                width += int(g) if len(g) < 12 else MAX_VALUE_CHARS + 1
    if stars:
        for a in args if isinstance(args, tuple) else (args,):
            if _is_int(a):
                width += abs(a)
    values = args.values() if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    size = len(fmt) + width + sum(_approx_size(a, MAX_VALUE_CHARS) for a in values)
    _check_value(size, "'%' formatting")


def _check_format_spec(spec: str) -> None:
    m = _FORMAT_SPEC.match(spec)
    if m is None:
        return  # not a standard spec: Python rejects it or the type formats it itself
    for g in m.groups():
        if g and (len(g) >= 12 or int(g) > MAX_VALUE_CHARS):
            raise TemplateError(f"chat template: format width/precision {g:.20} is too large "
                                f"(limit {MAX_VALUE_CHARS}); refusing to render it")


def _check_binop(op: str, left: Any, right: Any) -> None:
    seqs = (str, bytes, list, tuple)
    if op == "*":
        for a, b in ((left, right), (right, left)):
            if isinstance(a, seqs) and _is_int(b):
                _check_value(len(a) * max(b, 0), "'*' (repetition)")
        if _is_int(left) and _is_int(right) and int(left).bit_length() + int(right).bit_length() > MAX_INT_BITS:
            raise TemplateError("chat template: '*' would build an integer with more than "
                                f"{MAX_INT_BITS} bits; refusing to render it")
    elif op == "+":
        if isinstance(left, seqs) and isinstance(right, seqs):
            _check_value(len(left) + len(right), "'+' (concatenation)")
    elif op == "%":
        if isinstance(left, str):
            _check_printf(left, right)
    elif op == "**":
        if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            if right * int(left).bit_length() > MAX_INT_BITS:
                raise TemplateError("chat template: '**' would build an integer with more than "
                                    f"{MAX_INT_BITS} bits; refusing to render it")


def _check_str_method(obj: Any, args: tuple, kwargs: dict) -> None:
    """Checks for the bound methods of str/bytes/int that can build large values."""
    self_ = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "")
    if isinstance(self_, (str, bytes, bytearray)):
        if name in ("translate", "maketrans"):
            raise TemplateError(f"chat template: str.{name}() is not allowed")
        a = list(args) + list(kwargs.values())
        if name in ("center", "ljust", "rjust", "zfill") and a:
            _check_count(a[0], f"str.{name}() width")
        elif name == "expandtabs":
            size = a[0] if a and _is_int(a[0]) else 8
            _check_value(len(self_) + self_.count("\t" if isinstance(self_, str) else b"\t") * max(size, 0),
                         "str.expandtabs()")
        elif name == "replace" and len(a) >= 2:
            old, new = a[0], a[1]
            if isinstance(old, type(self_)) and isinstance(new, type(self_)):
                hits = self_.count(old) if old else len(self_) + 1
                _check_value(len(self_) + hits * len(new), "str.replace()")
        elif name == "join" and a:
            items = a[0]
            if isinstance(items, (list, tuple, str)):
                _check_value(sum(_approx_size(x, MAX_VALUE_CHARS) for x in items)
                             + len(self_) * len(items), "str.join()")
    elif _is_int(self_) and name == "to_bytes":
        a = list(args) + list(kwargs.values())
        if a:
            _check_count(a[0], "int.to_bytes() length")


# Argument checks for the filters that can build large values, with the filter's own
# signature (the value first). They raise TemplateError; a TypeError means the arguments do
# not bind, and the filter itself reports that.
def _fc_center(value, width=80):
    _check_count(width, "center width")


def _fc_indent(s, width=4, first=False, blank=False):
    w = len(width) if isinstance(width, str) else width
    if _is_int(w):
        _check_value(len(str(s)) + (str(s).count("\n") + 1) * max(w, 0), "indent")


def _fc_replace(s, old, new, count=None):
    s, old, new = str(s), str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    if _is_int(count) and count >= 0:
        hits = min(hits, count)
    _check_value(len(s) + hits * len(new), "replace")


def _fc_join(value, d="", attribute=None):
    if isinstance(value, (list, tuple, str)):
        _check_value(sum(_approx_size(x, MAX_VALUE_CHARS) for x in value) + len(str(d)) * len(value),
                     "join")


def _fc_format(value, *args, **kwargs):
    _check_printf(str(value), kwargs or args)


def _fc_batch(value, linecount, fill_with=None):
    _check_count(linecount, "batch size", 1 << 20)


def _fc_slice(value, slices, fill_with=None):
    _check_count(slices, "slice count", 1 << 20)


def _fc_wordwrap(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True):
    if isinstance(wrapstring, str) and _is_int(width) and width > 0:
        _check_value(len(str(s)) * (1 + len(wrapstring) // width + len(wrapstring)), "wordwrap")


def _fc_sum(iterable, attribute=None, start=0):
    if not isinstance(start, (int, float)):
        raise TemplateError("chat template: sum() with a non-numeric start is not allowed")


def _fc_stringify(value, *args, **kwargs):
    _check_value(_approx_size(value, MAX_VALUE_CHARS), "converting a value to text")


def _fc_urlize(value, trim_url_limit=None, nofollow=False, target=None, rel=None, extra_schemes=None):
    for x in (target, rel):
        if isinstance(x, str) and len(x) > 1000:
            raise TemplateError("chat template: urlize target/rel is too long")


_FILTER_CHECKS = {
    "center": _fc_center, "indent": _fc_indent, "replace": _fc_replace, "join": _fc_join,
    "format": _fc_format, "batch": _fc_batch, "slice": _fc_slice, "wordwrap": _fc_wordwrap,
    "sum": _fc_sum, "string": _fc_stringify, "pprint": _fc_stringify, "list": _fc_stringify,
    "urlize": _fc_urlize,
}


def _guard_filter(name: str, func):
    """Wraps a filter: counts a step, checks its arguments, counts what it builds."""
    check = _FILTER_CHECKS.get(name)
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(func)  # keeps jinja_pass_arg / jinja_async_variant
    def guarded(*args, **kwargs):
        _budget().tick()
        if name == "join" and len(args) > skip and not isinstance(args[skip], (list, tuple, str)):
            # a generator or range: materialise it (step-counted) so its size can be checked
            args = args[:skip] + (list(_guarded_iter(args[skip])),) + args[skip + 1:]
        if check is not None:
            try:
                check(*args[skip:], **kwargs)
            except TypeError:
                pass  # arguments that do not bind: the filter reports it
        return _produced(func(*args, **kwargs))

    return guarded


def _safe_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
    from jinja2.utils import generate_lorem_ipsum

    for v, what, lim in ((n, "lipsum n", 100), (min, "lipsum min", 1000), (max, "lipsum max", 1000)):
        _check_count(v, what, lim)
    return _produced(generate_lorem_ipsum(n=n, html=html, min=min, max=max))


def _guarded_iter(iterable: Any):
    """Every loop iterates through this: one step per item, the clock checked as it goes."""
    b = _budget()
    for item in iterable:
        b.tick()
        yield item


# --------------------------------------------------------------------------------------------
# The environment


def _make_environment():
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import (
        ImmutableSandboxedEnvironment,
        SandboxedEscapeFormatter,
        SandboxedFormatter,
        safe_range,
    )
    from jinja2.utils import pass_context

    class _GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class _CheckedFormatterMixin:
        def format_field(self, value, format_spec):
            _check_format_spec(format_spec)
            _budget().tick()
            return _produced(super().format_field(value, format_spec))

    class _CheckedFormatter(_CheckedFormatterMixin, SandboxedFormatter):
        pass

    class _CheckedEscapeFormatter(_CheckedFormatterMixin, SandboxedEscapeFormatter):
        pass

    class _LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "+", "%", "**", "//", "/", "-"])

        def call_binop(self, context, operator, left, right):
            _budget().tick()
            _check_binop(operator, left, right)
            return _produced(self.binop_table[operator](left, right))

        def getattr(self, obj, attribute):
            _budget().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _budget().tick()
            return super().getitem(obj, argument)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's convention
            _budget().tick()
            if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop
                args = (_guarded_iter(args[0]),) + args[1:]
            else:
                if getattr(__obj, "__name__", "") == "join" and args and \
                        isinstance(getattr(__obj, "__self__", None), (str, bytes)) and \
                        not isinstance(args[0], (list, tuple, str)):
                    args = (list(_guarded_iter(args[0])),) + args[1:]  # sized, so it is checked
                _check_str_method(__obj, args, kwargs)
            return _produced(super().call(__context, __obj, *args, **kwargs))

        # jinja2 >= 3.1.5 sandboxes str.format at attribute access ...
        def wrap_str_format(self, value):
            import types

            if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
                    value.__name__ not in ("format", "format_map"):
                return None
            f_self = value.__self__
            if not isinstance(f_self, str):
                return None
            from markupsafe import Markup

            fmt = (_CheckedEscapeFormatter(self, escape=f_self.escape) if isinstance(f_self, Markup)
                   else _CheckedFormatter(self))
            is_map = value.__name__ == "format_map"

            def wrapper(*args, **kwargs):
                if is_map:
                    if kwargs or len(args) != 1:
                        raise TypeError("format_map() takes exactly one positional argument")
                    kwargs, args = args[0], ()
                return type(f_self)(fmt.vformat(f_self, args, kwargs))

            return functools.update_wrapper(wrapper, value)

        # ... older 3.1 releases in call(), through format_string
        def format_string(self, s, args, kwargs, format_func=None):
            from markupsafe import Markup

            fmt = (_CheckedEscapeFormatter(self, escape=s.escape) if isinstance(s, Markup)
                   else _CheckedFormatter(self))
            if format_func is not None and format_func.__name__ == "format_map":
                if len(args) != 1 or kwargs:
                    raise TypeError("format_map() takes exactly one positional argument")
                kwargs, args = args[0], ()
            return type(s)(fmt.vformat(s, args, kwargs))

    env = _LimitedSandbox(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        autoescape=False,
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    for name, func in list(env.filters.items()):
        env.filters[name] = _guard_filter(name, func)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["lipsum"] = _safe_lipsum

    def _range(*args):
        for a in args:
            _check_count(abs(a) if _is_int(a) else a, "range() bound", 1 << 40)
        return safe_range(*args)  # at most jinja2.sandbox.MAX_RANGE items

    env.globals["range"] = _range

    # Internal filters the compiled template calls; pass_context keeps jinja from running
    # them at compile time (constant folding).
    @pass_context
    def tf_iter(context, iterable):
        return _guarded_iter(iterable)

    @pass_context
    def tf_out(context, n):
        _budget().produce(n)
        return ""

    @pass_context
    def tf_emit(context, value):
        b = _budget()
        b.tick()
        if not isinstance(value, str):
            _check_value(_approx_size(value, MAX_VALUE_CHARS), "an output expression")
            value = str(value)
        b.produce(len(value))
        return value

    @pass_context
    def tf_concat(context, parts):
        _check_value(sum(_approx_size(p, MAX_VALUE_CHARS) for p in parts), "'~' (concatenation)")
        return _produced("".join(map(str, parts)))

    env.filters.update(__tf_iter=tf_iter, __tf_out=tf_out, __tf_emit=tf_emit,
                       __tf_concat=tf_concat)

    from jinja2.visitor import NodeTransformer

    def _wrap(node, name):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class _Instrument(NodeTransformer):
        """Routes every loop, output and '~' of a parsed template through the filters above."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = _wrap(node.iter, "__tf_iter")
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return _wrap(nodes.List(node.nodes, lineno=node.lineno), "__tf_concat")

        def visit_Output(self, node):
            node = self.generic_visit(node)
            static = sum(len(n.data) for n in node.nodes if isinstance(n, nodes.TemplateData))
            out = [_wrap(nodes.Const(static, lineno=node.lineno), "__tf_out")]
            for n in node.nodes:
                out.append(n if isinstance(n, nodes.TemplateData) else _wrap(n, "__tf_emit"))
            node.nodes = out
            return node

    env.tf_instrument = lambda ast: _Instrument().visit(ast)
    return env


@functools.lru_cache(maxsize=1)
def _environment():
    return _make_environment()


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2

    env = _environment()
    try:
        ast = env.parse(template)
        ast = env.tf_instrument(ast)
        ast.set_environment(env)
        return env.from_string(ast)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template could not be compiled: {e}") from e
    except RecursionError as e:
        raise TemplateError("chat template is nested too deeply to compile") from e


def check_role(role: Any, where: str = "role") -> str:
    """The role a chat template sees for a message's `role`: one of ROLES, with "developer"
    given as "system". Anything else raises ValueError naming the valid roles, e.g.
    "messages[2].role must be one of ['assistant', 'developer', 'system', 'tool', 'user'],
    got 'wizard'" (`where` names the field)."""
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{where} must be one of {sorted(ROLES)}, got {role!r}")
    return "system" if role == "developer" else role


def check_roles(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """`messages` with every role checked by check_role (as messages[i].role) and "developer"
    given as "system"; messages that are not mappings are left to validate_messages. Returns
    a new list (the dicts are copied only where a role changes)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            role = check_role(m.get("role"), f"messages[{i}].role")
            if role != m.get("role"):
                m = dict(m, role=role)
        out.append(m)
    return out


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

    if template is None or (isinstance(template, str) and not template):
        template = DEFAULT_CHATML_TEMPLATE
    if not isinstance(template, str):
        # e.g. a GGUF whose tokenizer.chat_template is a number or an array
        raise TemplateError(f"chat template must be a string, got {type(template).__name__}")
    if len(template) > _MAX_TEMPLATE_CHARS:
        raise TemplateError(f"chat template is too long ({len(template)} characters)")
    msgs = validate_messages(messages)
    ctx = dict(extra)
    ctx.update(
        messages=msgs,
        add_generation_prompt=bool(add_generation_prompt),
        bos_token=bos_token,
        eos_token=eos_token,
        tools=tools,  # passed even when None, as transformers and llama-cpp-python do
    )
    budget = _Budget()
    outer = getattr(_local, "budget", None)
    _local.budget = budget
    try:
        compiled = _compile(template)
        # Streamed, so an oversized prompt is cut off at the limit instead of being built.
        parts: list[str] = []
        total = 0
        gen = compiled.generate(**ctx)
        try:
            for chunk in gen:
                total += len(chunk)
                if total > MAX_OUTPUT_CHARS:
                    raise TemplateError(f"chat template: the rendered prompt is longer than "
                                        f"{MAX_OUTPUT_CHARS} characters; refusing to render it")
                budget.check_time()
                parts.append(chunk)
        finally:
            gen.close()
        if budget.exceeded:  # a limit was hit and something swallowed the error
            raise TemplateError(budget.exceeded)
        return "".join(parts)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"chat template tried an operation the sandbox forbids: {e}") from e
    except jinja2.TemplateError as e:
        raise TemplateError(f"chat template failed to render: {e}") from e
    except (TypeError, KeyError, AttributeError, IndexError, ValueError, ZeroDivisionError,
            OverflowError, UnicodeError) as e:
        raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e
    except RecursionError as e:
        raise TemplateError("chat template recursed too deeply") from e
    except MemoryError as e:
        raise TemplateError("chat template ran out of memory while rendering") from e
    finally:
        _local.budget = outer
