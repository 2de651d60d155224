"""Chat prompt rendering, exactly as ``transformers`` renders it.

A model folder's Jinja chat template is rendered in the same sandbox, with the same globals and
filters, as ``PreTrainedTokenizerBase.apply_chat_template(tokenize=False)`` (transformers 5.x,
``transformers/utils/chat_template_utils.py``), so the prompt a model sees here is byte for byte the
prompt it was trained and evaluated with. Before rendering, OpenAI-style messages are normalised into
the shape Hugging Face templates expect (see :func:`normalize_messages`).

A folder without a template falls back to the spec's ChatML prompt (:func:`render_chatml`).

This module is pure Python (jinja2 only): the router imports it, and the router never imports torch.

Why one module of ~500 lines: it mirrors one thing, transformers' template environment (the
sandbox, its globals and filters, the ``{% generation %}`` tag, the message normalisation and the
ChatML fallback), and those parts change together when transformers changes.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import json
import re
import threading
import time
from collections.abc import Generator, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.debug  # noqa: F401 - see _Watchdog: handle_exception must not import it mid-render
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .toolformats import ToolFormat, detect
from .tools import TOOLS_POSTAMBLE, TOOLS_PREAMBLE

__all__ = [
    "ChatTemplate",
    "TemplateBoundError",
    "TemplateError",
    "normalize_messages",
    "render_budget",
    "render_chatml",
    "think_open",
]

THINK_OPEN = "<think>"

# Names transformers passes to every template from ``tokenizer.special_tokens_map``
# (``SPECIAL_TOKENS_ATTRIBUTES``), when the tokenizer has them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Variables the renderer sets itself; a client's chat_template_kwargs may not replace them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})

# The names a message's reasoning may come under. transformers copies the first one found into
# ``reasoning_content`` (what most templates read) and ``thinking`` (what gpt-oss templates read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(ValueError):
    """The conversation cannot be rendered (``raise_exception`` in the template, an undefined value,
    a malformed message, a broken template). The HTTP layer answers it with a 400."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class TemplateBoundError(TemplateError):
    """A render went past one of the bounds below (time, size, range, nesting): the template's
    fault or the conversation's, never a reason to hold the server. ``bound`` names which."""

    def __init__(self, message: str, bound: str):
        super().__init__(message)
        self.bound = bound


# ------------------------------------------------------------------ bounds
#
# A chat template is code from a model folder (or a GGUF's metadata), rendered on every request.
# Jinja's sandbox keeps it from reaching out of the template, but not from spending: a nested
# ``range()`` loop or ``'x' * 200000000`` would hold the router's event loop (and SIGTERM with it)
# for as long as it likes. So every render runs under bounds, each of which ends it with a
# ``TemplateBoundError`` (a 400 naming the template and the bound):
#
# - time: ``RENDER_TIMEOUT_S`` per request, all its renders together (``render_budget``), and
#   ``LOAD_TIMEOUT_S`` for the sample render at load. The hooks below check the deadline, and a
#   watchdog thread raises in the rendering thread when it passes anyway (a loop whose body calls
#   nothing, which no hook sees; ``WATCHDOG_GRACE_S`` later, so that a hook ends the usual stall
#   first), so a render always ends itself;
# - size: no string or list a template builds (``*``, ``+``, ``~``, ``%``, filters, str methods)
#   and not the output may pass ``MAX_OUTPUT_CHARS`` plus ``OUTPUT_PER_INPUT`` times the input's
#   size. Sizes are checked before the allocation wherever they can be known (a repetition, a
#   width, a join), so ``'x' * 200000000`` is refused without allocating it;
# - ``range()``: at most ``MAX_RANGE`` items (real templates loop over messages, not ranges);
# - nesting: at most ``MAX_CALL_DEPTH`` nested calls (macros calling macros, recursive loops).
#
# At load the template is rendered once on a small sample conversation under the load bounds; a
# template that exceeds them is refused there (``ChatTemplate.check_cost``).

RENDER_TIMEOUT_S = 0.5
LOAD_TIMEOUT_S = 0.25
MAX_OUTPUT_CHARS = 1 << 20
OUTPUT_PER_INPUT = 4
LOAD_MAX_OUTPUT_CHARS = 1 << 18
MAX_RANGE = 10_000
MAX_CALL_DEPTH = 128
WATCHDOG_GRACE_S = 0.1


class _RenderInterrupted(BaseException):
    """Raised in a rendering thread by the watchdog. A BaseException, so that no ``except
    Exception`` on the way (Jinja's, a filter's) swallows it."""


class _Bounds:
    __slots__ = ("name", "deadline", "timeout", "max_chars", "depth", "watchdog_key")

    def __init__(self, name: str, deadline: float, timeout: float, max_chars: int):
        self.name = name
        self.deadline = deadline
        self.timeout = timeout
        self.max_chars = max_chars
        self.depth = 0
        self.watchdog_key: int | None = None

    def exceeded(self, bound: str, detail: str) -> TemplateBoundError:
        # The render is ending by an exception now, and Jinja's handling of it (traceback
        # rewriting) runs library code that holds locks: the watchdog must not interrupt that.
        if self.watchdog_key is not None:
            _WATCHDOG.disarm(self.watchdog_key)
            self.watchdog_key = None
        return TemplateBoundError(f"{self.name} exceeded its {bound} bound: {detail}", bound)

    def late(self) -> TemplateBoundError:
        return self.exceeded("time", f"rendering took more than {self.timeout:g} s")

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.late()

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise self.exceeded("size", f"{what} of {n} items, more than {self.max_chars}")


_LOCAL = threading.local()  # .bounds: the _Bounds of this thread's render; .budget: a deadline


def _bounds() -> _Bounds | None:
    return getattr(_LOCAL, "bounds", None)


@contextlib.contextmanager
def render_budget(seconds: float = RENDER_TIMEOUT_S) -> Iterator[None]:
    """All renders of this thread inside the block share one deadline, ``seconds`` from now (the
    renders of one request: ``fit_context`` renders again while it caps a conversation)."""
    outer = getattr(_LOCAL, "budget", None)
    _LOCAL.budget = time.monotonic() + seconds if outer is None else min(outer, time.monotonic() + seconds)
    try:
        yield
    finally:
        _LOCAL.budget = outer


def _interrupt(ident: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


class _Watchdog:
    """One daemon thread that interrupts renders past their deadline (see the bounds above).

    An asynchronous exception lands at whatever bytecode the thread runs; one that lands inside
    ``importlib`` (a lazy import) leaves a module lock held and deadlocks every later importer
    (it froze SIGTERM: the executor's threads never ended). So the watchdog fires only
    ``WATCHDOG_GRACE_S`` after the deadline the hooks check, a hook's bound error disarms it
    before Jinja handles the error, and ``jinja2.debug``, which that handling imports, is
    imported with this module.

    ``arm`` registers the calling thread until a deadline; ``disarm`` ends that, and afterwards no
    interruption can be pending for it (one raised meanwhile is cleared before it lands, or it
    landed inside the armed block, which turns it into a ``TemplateBoundError``)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: dict[int, tuple[float, int]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float) -> int:
        with self._cv:
            self._next += 1
            key = self._next
            self._armed[key] = (deadline, threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="template-watchdog", daemon=True)
                self._thread.start()
            self._cv.notify()
            return key

    def disarm(self, key: int) -> None:
        with self._cv:
            if self._armed.pop(key, None) is None:  # it fired: clear it if it has not landed
                _interrupt(threading.get_ident(), None)

    def _run(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                for key, (deadline, ident) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        _interrupt(ident, _RenderInterrupted)
                nearest = min((d for d, _ in self._armed.values()), default=None)
                self._cv.wait(None if nearest is None else max(0.0, nearest - now) + 0.005)


_WATCHDOG = _Watchdog()
_WIDTH = re.compile(r"\d+")


def _check_widths(fmt: Any, what: str) -> None:
    """A format string's widths and precisions (``%2000000000s``, ``{:2000000000}``) are
    allocations: refuse a large one before it is made."""
    b = _bounds()
    if b is not None and isinstance(fmt, str):
        for m in _WIDTH.finditer(fmt):
            if len(m.group()) > 9 or int(m.group()) > b.max_chars:
                raise b.exceeded("size", f"{what} with a width of {m.group()}")


def _check_args(args: Sequence[Any], kwargs: Mapping[str, Any], what: str) -> None:
    """An integer argument of a str method or filter is a width, a count or an indent: one beyond
    the size bound would allocate beyond it."""
    b = _bounds()
    if b is None:
        return
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and v > b.max_chars:
            raise b.exceeded("size", f"{what} with an argument of {v}")


def _sized(result: Any, what: str) -> Any:
    b = _bounds()
    if b is not None and isinstance(result, (str, list, tuple)):
        b.check_size(len(result), what)
    return result


def _len(x: Any) -> int:
    try:
        return len(x)
    except TypeError:
        return len(str(x))


def _str_join(seq: Any) -> str:
    """``~``: Jinja's own ``str_join``, sized first."""
    parts = [str(x) for x in seq]
    b = _bounds()
    if b is not None:
        b.check_size(sum(map(len, parts)), "a '~' concatenation")
    return "".join(parts)


def _markup_join(seq: Any) -> str:
    parts = list(seq)
    b = _bounds()
    if b is not None:
        b.check_size(sum(_len(x) for x in parts), "a '~' concatenation")
    return jinja2.runtime.markup_join(parts)


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """Jinja's code generator, with ``~`` going through the sized joins above."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        if frame.eval_ctx.volatile:
            func = "(environment.pantheon_markup_join if context.eval_ctx.volatile else environment.pantheon_str_join)"
        elif frame.eval_ctx.autoescape:
            func = "environment.pantheon_markup_join"
        else:
            func = "environment.pantheon_str_join"
        self.write(f"{func}((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _range(*args: int) -> range:
    rng = range(*args)
    b = _bounds()
    if b is not None and len(rng) > MAX_RANGE:
        raise b.exceeded("range", f"range() of {len(rng)} items, more than {MAX_RANGE}")
    return rng


_SEQ = (str, list, tuple)
_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)
# the built-in filters whose output can be much larger than their input
_SIZED_FILTERS = ("center", "indent", "wordwrap", "format", "join", "replace", "truncate")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with the bounds above on what a render may spend."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})
    pantheon_str_join = staticmethod(_str_join)
    pantheon_markup_join = staticmethod(_markup_join)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _bounds()
        if b is not None:
            b.check_time()
            if operator == "*":
                seq, n = (left, right) if isinstance(left, _SEQ) else (right, left)
                if isinstance(seq, _SEQ) and isinstance(n, int):
                    b.check_size(len(seq) * max(n, 0), "a '*' repetition")
            elif operator == "+" and isinstance(left, _SEQ) and isinstance(right, _SEQ):
                b.check_size(len(left) + len(right), "a '+' concatenation")
            elif operator == "%" and isinstance(left, str):
                _check_widths(left, "a '%' format")
                if isinstance(right, tuple):
                    _check_args(right, {}, "a '%' format")
            elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
                if abs(right) > 64 and abs(left) > 1:
                    raise b.exceeded("size", f"a '**' power of {right}")
        return _sized(self.binop_table[operator](left, right), f"a '{operator}' result")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        b = _bounds()
        if b is None:
            return super().call(__context, __obj, *args, **kwargs)
        b.check_time()
        target = getattr(__obj, "__wrapped__", __obj)
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "")
            what = f"str.{name}()"
            _check_args(args, kwargs, what)
            if name in ("format", "format_map"):
                _check_widths(owner, what)
            elif (
                name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str)
            ):
                grow = (owner.count(args[0]) + (1 if not args[0] else 0)) * (len(args[1]) - len(args[0]))
                b.check_size(len(owner) + max(grow, 0), what)
            elif name == "join" and args:
                args = (list(args[0]),)
                b.check_size(sum(_len(x) for x in args[0]) + len(owner) * len(args[0]), what)
        b.depth += 1
        try:
            if b.depth > MAX_CALL_DEPTH:
                raise b.exceeded("nesting", f"more than {MAX_CALL_DEPTH} nested calls")
            return _sized(super().call(__context, __obj, *args, **kwargs), "a call's result")
        finally:
            b.depth -= 1


def _bounded_filter(fn: Any, name: str) -> Any:
    """A filter that produces text, with its integer arguments and its result sized."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        b = _bounds()
        if b is None:  # constant folding at compile time: leave it to the (bounded) render
            raise jinja2.nodes.Impossible()
        b.check_time()
        what = f"the '{name}' filter"
        lead = 1 if args and isinstance(args[0], _PASSED) else 0
        value, extra = (args[lead], args[lead + 1 :]) if len(args) > lead else (None, ())
        _check_args(extra, kwargs, what)
        if name == "format":
            _check_widths(value, what)
        elif name == "join" and value is not None and not isinstance(value, str):
            value = list(value)
            args = (*args[:lead], value, *extra)
            sep = extra[0] if extra and isinstance(extra[0], str) else ""
            b.check_size(sum(_len(x) for x in value) + len(sep) * len(value), what)
        elif name == "replace" and isinstance(value, str) and len(extra) >= 2:
            old, new = str(extra[0]), str(extra[1])
            grow = (value.count(old) + (1 if not old else 0)) * (len(new) - len(old))
            b.check_size(len(value) + max(grow, 0), what)
        return _sized(fn(*args, **kwargs), what)

    for attr in ("jinja_pass_arg",):
        if hasattr(fn, attr):
            setattr(wrapper, attr, getattr(fn, attr))
    return wrapper


# ------------------------------------------------------------------ the Jinja environment
#
# Everything below mirrors ``_cached_compile_jinja_template`` in transformers.


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes and sorts keys; transformers' does neither.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without attribute access that could lead out of the sandbox."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant tokens for
    training masks. Serving only needs the text, so the block renders its body unchanged; without
    the tag such templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    for name in _SIZED_FILTERS:
        env.filters[name] = _bounded_filter(env.filters[name], name)
    env.filters["tojson"] = _bounded_filter(_tojson, "tojson")
    env.globals["range"] = _range
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _make_environment()


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from exc


# ------------------------------------------------------------------ OpenAI -> Hugging Face messages


def _text_of(content: Any, where: str) -> Any:
    """OpenAI allows ``content`` as a list of parts; templates want one string.

    Text parts are joined with a newline (as vLLM does). Any other part type (images, audio) is
    refused: no model served here takes them.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, Mapping)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"{where}: content part of type {kind!r} is not supported, only text")
    return "\n".join(texts)


def _normalize_tool_call(call: Any, where: str, object_arguments: bool) -> Any:
    if not isinstance(call, Mapping):
        raise TemplateError(f"{where}: a tool call must be an object")
    call = {k: v for k, v in call.items() if v is not None}
    fn = call.get("function")
    if isinstance(fn, Mapping):
        fn = {k: v for k, v in fn.items() if v is not None}
        args = fn.get("arguments")
        if object_arguments and isinstance(args, str):
            # Qwen-style templates render ``arguments | tojson`` and expect a dict; OpenAI clients send
            # the JSON text. Text that is not JSON is left alone (templates then print it verbatim).
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except ValueError:
                pass
        elif not object_arguments and args is not None and not isinstance(args, str):
            # a template that concatenates the arguments as text (Functionary v3.2's)
            fn["arguments"] = _tojson(args)
        call["function"] = fn
    return call


def normalize_messages(
    messages: Sequence[Mapping[str, Any]], *, object_arguments: bool = True
) -> list[dict[str, Any]]:
    """Turn OpenAI chat messages into the dicts Hugging Face chat templates expect.

    - keys whose value is ``None`` are dropped (as transformers does: templates test for a missing
      key, not for None), except ``content``, which becomes ``""`` (the Qwen3 template crashes on an
      assistant message without content, which OpenAI clients send on tool-call turns);
    - ``content`` given as a list of text parts is joined into one string;
    - an empty ``tool_calls`` list is dropped (Llama 3 templates test ``'tool_calls' in message``);
    - ``tool_calls[].function.arguments`` JSON strings are parsed into dicts (what transformers
      documents and nearly every template reads); with ``object_arguments`` False, for a template
      that takes them as text (:attr:`ChatTemplate.object_arguments`), objects are written as JSON
      text instead;
    - reasoning given as ``reasoning_content``, ``thinking`` or ``reasoning`` is offered to the
      template under the first two names (as transformers does);
    - tool messages keep ``tool_call_id`` and ``name``.

    The input is not modified.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TemplateError("messages must be a list")
    if not messages:
        raise TemplateError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise TemplateError(f"{where} must be an object")
        if not isinstance(message.get("role"), str):
            raise TemplateError(f"{where}: missing 'role'")
        msg = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        msg["content"] = _text_of(msg.get("content", ""), where)
        for field in _REASONING_FIELDS:
            if field in msg:
                msg[field] = _text_of(msg[field], where)
        calls = msg.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise TemplateError(f"{where}: tool_calls must be a list")
            if calls:
                msg["tool_calls"] = [
                    _normalize_tool_call(c, f"{where}.tool_calls[{j}]", object_arguments)
                    for j, c in enumerate(calls)
                ]
            else:
                del msg["tool_calls"]
        reasoning = next((msg[f] for f in _REASONING_FIELDS if msg.get(f) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


# ------------------------------------------------------------------ the ChatML fallback


def render_chatml(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    reasoning: bool = False,
    enable_thinking: bool | None = None,
) -> str:
    """The spec's built-in prompt for models without a chat template.

    Each turn is ``<|im_start|>role\\ncontent<|im_end|>\\n``. Tool results are wrapped in
    ``<tool_response>`` inside a user turn (consecutive ones share that turn); an assistant's tool
    calls are written as ``<tool_call>`` blocks; tools, when given, are listed in the system turn in
    the Qwen/Hermes form that the emitter's ``<tool_call>`` parser reads back. With
    ``add_generation_prompt`` the assistant turn is opened, and for a reasoning model a ``<think>``
    is opened after it (an empty ``<think>`` block instead when ``enable_thinking`` is False).

    ``messages`` must already be normalised (:func:`normalize_messages`).
    """
    parts: list[str] = []
    rest = list(messages)
    if tools:
        system = ""
        if rest and rest[0].get("role") == "system":
            system = str(rest.pop(0).get("content", "")) + "\n\n"
        listing = "".join("\n" + _tojson(t) for t in tools)
        parts.append(f"<|im_start|>system\n{system}{TOOLS_PREAMBLE}{listing}{TOOLS_POSTAMBLE}<|im_end|>\n")
    for i, msg in enumerate(rest):
        role = msg.get("role")
        content = msg.get("content", "")
        content = "" if content is None else str(content)
        if role == "tool":
            if i == 0 or rest[i - 1].get("role") != "tool":
                parts.append("<|im_start|>user")
            parts.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == len(rest) - 1 or rest[i + 1].get("role") != "tool":
                parts.append("<|im_end|>\n")
            continue
        if role == "assistant" and msg.get("tool_calls"):
            blocks = []
            for call in msg["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments", {})
                args = args if isinstance(args, str) else _tojson(args)
                blocks.append(
                    f'<tool_call>\n{{"name": "{fn.get("name", "")}", "arguments": {args}}}\n</tool_call>'
                )
            content = "\n".join([content] + blocks) if content else "\n".join(blocks)
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if reasoning:
            parts.append("<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n")
    return "".join(parts)


def think_open(prompt: str) -> bool:
    """True when the prompt ends inside an opened ``<think>`` (the template pre-filled it), so the
    model's first tokens are reasoning. Feed this to ``Emitter(think_open=...)``."""
    return prompt.rstrip().endswith(THINK_OPEN)


# ------------------------------------------------------------------ ChatTemplate


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise TemplateError(f"{path.name} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


class ChatTemplate:
    """A model's chat prompt format.

    ``template`` is the Jinja source (None: the ChatML fallback); ``tool_use_template`` is used
    instead when tools are passed (transformers' ``"tool_use"`` named template). The special tokens
    are offered to the template as ``bos_token``, ``eos_token`` and, through ``special_tokens``,
    any other of transformers' named ones (``pad_token``, ``unk_token``, ...). ``reasoning`` says
    the model thinks in ``<think>`` blocks: it only changes the ChatML fallback, since a real template
    encodes this itself.

    ``name`` names the template in errors (``the chat template of <model> (<file>)``).

    Raises :class:`TemplateError` when a template does not compile.
    """

    def __init__(
        self,
        template: str | None = None,
        *,
        tool_use_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        reasoning: bool = False,
        name: str = "the chat template",
    ):
        self.name = name
        self.source = template
        self.tool_use_source = tool_use_template
        self.reasoning = bool(reasoning)
        tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        if bos_token is not None:
            tokens["bos_token"] = bos_token
        if eos_token is not None:
            tokens["eos_token"] = eos_token
        self.special_tokens: dict[str, str] = tokens
        self._compiled = _compile(template) if template is not None else None
        self._compiled_tool_use = _compile(tool_use_template) if tool_use_template is not None else None

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @functools.cached_property
    def tool_syntax(self) -> ToolFormat:
        """The format the model writes tool calls (and reasoning) in, as the template that
        renders the tools teaches it (:func:`pantheon.chat.toolformats.detect`)."""
        return detect(self.tool_use_source or self.source)

    @property
    def tool_format(self) -> str:
        """The name of :attr:`tool_syntax` (``"json"``, ``"xml"``, ``"llama3"``, ...)."""
        return self.tool_syntax.name

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the template renders the ``tools`` it is given: a sample conversation
        rendered with a sample tool (under the load bounds) shows the tool's name. One that does
        not (SmolLM2's) gets the generic tool prompt instead
        (:func:`pantheon.chat.tools.with_tool_prompt`). A template that refuses the sample is
        taken at its word: it knows tools."""
        if self.is_fallback:
            return True
        try:
            text = self._load_render(_SAMPLE_MESSAGES, _SAMPLE_TOOLS)
        except TemplateBoundError:
            raise
        except TemplateError:
            return True
        return _SAMPLE_TOOLS[0]["function"]["name"] in text

    @functools.cached_property
    def object_arguments(self) -> bool:
        """Whether the template takes a tool call's ``arguments`` as an object (what transformers
        documents, and what nearly every template reads: ``arguments | tojson``, ``arguments.items()``)
        rather than as the JSON text OpenAI clients send (Functionary v3.2's template concatenates
        it: ``'>>>' + name + '\\n' + arguments``).

        As llama.cpp decides it (``supports_object_arguments``), from the template itself: a sample
        tool call is rendered with its arguments as an object and, when that fails or prints the
        object's Python form, as text; text is kept only when it renders the arguments' JSON.
        """
        if self.is_fallback:
            return True
        sample = _SAMPLE_CALL_MESSAGES
        try:
            text = self._load_render(sample, _SAMPLE_TOOLS, object_arguments=True)
            if _SAMPLE_ARGUMENTS_REPR not in text:
                return True
        except TemplateBoundError:
            raise
        except TemplateError:
            pass
        try:
            text = self._load_render(sample, _SAMPLE_TOOLS, object_arguments=False)
        except TemplateBoundError:
            raise
        except TemplateError:
            return True
        return _SAMPLE_ARGUMENTS_JSON not in text

    @property
    def is_fallback(self) -> bool:
        """True when the model has no template and the ChatML fallback is used."""
        return self._compiled is None and self._compiled_tool_use is None

    @classmethod
    def from_model_dir(cls, path: str | Path, *, reasoning: bool | None = None) -> ChatTemplate:
        """Load the template of a Hugging Face model folder, as transformers finds it.

        Sources, the later winning as in transformers: ``chat_template`` in tokenizer_config.json
        (a string, or a list of ``{name, template}`` of which "default" and "tool_use" are kept),
        ``chat_template.json`` (older processor format), ``chat_template.jinja``, and named templates
        in ``additional_chat_templates/*.jinja``. Special tokens come from tokenizer_config.json.
        ``reasoning`` None means: the tokenizer has a ``<think>`` token.
        """
        folder = Path(path)
        config = _read_json(folder / "tokenizer_config.json")
        templates: dict[str, str] = {}
        origin: dict[str, str] = {}  # where each came from, to name it in errors
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
            origin["default"] = "tokenizer_config.json"
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                    key = str(entry.get("name", "default"))
                    templates[key] = entry["template"]
                    origin[key] = f"tokenizer_config.json, {key!r}"
        legacy = _read_json(folder / "chat_template.json").get("chat_template")
        if isinstance(legacy, str):
            templates["default"] = legacy
            origin["default"] = "chat_template.json"
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
            origin["default"] = "chat_template.jinja"
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            for file in sorted(extra.glob("*.jinja")):
                key = file.name.removesuffix(".jinja")
                templates[key] = file.read_text(encoding="utf-8")
                origin[key] = f"additional_chat_templates/{file.name}"

        # transformers refuses a set of named templates without a "default"; a server should still
        # serve it, so the first one stands in.
        default = templates.get("default")
        used = "default"
        if default is None and templates:
            used = next(iter(k for k in templates if k != "tool_use"), "tool_use")
            default = templates.get(used) if used != "tool_use" else None
        tool_use = templates.get("tool_use")
        files = ", ".join(dict.fromkeys(origin[k] for k in (used, "tool_use") if k in origin))
        label = f"the chat template of {folder.name}" + (f" ({files})" if files else "")

        tokens = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(config.get(name))
            if text is not None:
                tokens[name] = text
        if reasoning is None:
            reasoning = _has_think_token(folder, config)
        return cls(
            default, tool_use_template=tool_use, special_tokens=tokens, reasoning=reasoning, name=label
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style ``messages`` into the prompt text.

        ``tools`` are the OpenAI tool definitions, passed to the template unchanged (None: no
        tools). ``template_kwargs`` are the request's ``chat_template_kwargs`` (``enable_thinking``
        and the like); they may override the special tokens but not the four names the renderer
        sets itself. The result is meant to be tokenized without adding special tokens.

        Raises :class:`TemplateError` for anything that stops the template (a 400 for the client),
        :class:`TemplateBoundError` when the render passes a bound (time, size, range, nesting).
        """
        return self._render(messages, tools, documents, add_generation_prompt, template_kwargs, None)

    def _load_render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        object_arguments: bool | None = None,
    ) -> str:
        """A sample render at load, under the load bounds (``LOAD_TIMEOUT_S``,
        ``LOAD_MAX_OUTPUT_CHARS``). One past the time bound is rendered once more: a sample that
        takes milliseconds was held past 0.25 s on the wall clock by a busy 2-core host (a full
        CI run refused the real SmolLM2 template so), where a template that is really that slow
        is past it again; the other bounds are not timing and refuse at once."""
        limits = (LOAD_TIMEOUT_S, LOAD_MAX_OUTPUT_CHARS)
        try:
            return self._render(messages, tools, None, True, {}, limits, object_arguments=object_arguments)
        except TemplateBoundError as e:
            if e.bound != "time":
                raise
        return self._render(messages, tools, None, True, {}, limits, object_arguments=object_arguments)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        documents: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
        limits: tuple[float, int] | None,
        *,
        object_arguments: bool | None = None,
    ) -> str:
        if object_arguments is None:
            calls = any(isinstance(m, Mapping) and m.get("tool_calls") for m in messages)
            # the probe renders only when it matters: a conversation with tool calls
            object_arguments = self.object_arguments if calls else True
        msgs = normalize_messages(messages, object_arguments=object_arguments)
        tools = list(tools) if tools is not None else None
        msgs, tools, template_kwargs = self.tool_syntax.adapt(msgs, tools, template_kwargs)
        clash = _RESERVED_KWARGS.intersection(template_kwargs)
        if clash:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(clash)}")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TemplateError("documents must be a list of objects")

        compiled = (
            self._compiled_tool_use if (tools is not None and self._compiled_tool_use) else self._compiled
        )
        if compiled is None:
            compiled = self._compiled_tool_use
        if compiled is None:
            enable = template_kwargs.get("enable_thinking")
            return render_chatml(
                msgs,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                reasoning=self.reasoning,
                enable_thinking=enable if isinstance(enable, bool) else None,
            )
        context = {**self.special_tokens, **copy.deepcopy(template_kwargs)}
        variables = {
            "messages": msgs,
            "tools": copy.deepcopy(tools),
            "documents": copy.deepcopy(list(documents)) if documents is not None else None,
            "add_generation_prompt": add_generation_prompt,
            **context,
        }
        if limits is None:
            size = len(json.dumps([msgs, tools, documents, template_kwargs], ensure_ascii=False, default=str))
            limits = (RENDER_TIMEOUT_S, MAX_OUTPUT_CHARS + OUTPUT_PER_INPUT * size)
        name = self.name + (
            " (its tool_use template)" if compiled is self._compiled_tool_use and self._compiled else ""
        )
        try:
            return _render_bounded(compiled, variables, name, *limits)
        except TemplateBoundError:
            raise
        except jinja2.TemplateError as exc:
            # raise_exception(), undefined values, sandbox refusals.
            raise TemplateError(str(exc) or type(exc).__name__) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # A template doing arithmetic on what the client sent (``'a' + none``, ``[0]`` on an
            # empty list): still the request's fault, not the server's.
            raise TemplateError(f"chat template failed on this conversation: {exc}") from exc

    def check_cost(self) -> None:
        """Render a small sample conversation (with and without tools) under the load bounds
        (``LOAD_TIMEOUT_S``, ``LOAD_MAX_OUTPUT_CHARS``): raises :class:`TemplateBoundError` when
        the template exceeds them, so a model whose template would stall every request is refused
        at load. A template that merely refuses the sample (``raise_exception``) passes."""
        for tools in (None, _SAMPLE_TOOLS):
            try:
                self._load_render(_SAMPLE_MESSAGES, tools)
            except TemplateBoundError:
                raise
            except TemplateError:
                pass


_SAMPLE_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "It is sunny in Paris today."},
    {"role": "user", "content": "And tomorrow?"},
)
_SAMPLE_ARGUMENTS = {"city": "Paris"}
_SAMPLE_ARGUMENTS_JSON = json.dumps(_SAMPLE_ARGUMENTS)  # '{"city": "Paris"}'
_SAMPLE_ARGUMENTS_REPR = repr(_SAMPLE_ARGUMENTS)  # "{'city': 'Paris'}": a template printing a dict
# A tool call, its result and an answer (not a user turn straight after a result: Mistral's
# templates refuse that), to see how a template reads a call's arguments (``object_arguments``).
_SAMPLE_CALL_MESSAGES = (
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call00001",  # 9 alphanumerics: what Mistral's templates demand
                "type": "function",
                "function": {"name": "get_weather", "arguments": _SAMPLE_ARGUMENTS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny in Paris."},
    {"role": "user", "content": "And tomorrow?"},
)
_SAMPLE_TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather forecast of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
)


def _render_bounded(
    compiled: jinja2.Template, variables: dict[str, Any], name: str, timeout: float, max_chars: int
) -> str:
    """Render under the bounds (see the module's bounds section): the output streamed with a
    running size and deadline check, the watchdog armed for what no check sees."""
    now = time.monotonic()
    deadline = now + timeout
    budget = getattr(_LOCAL, "budget", None)
    if budget is not None:
        deadline = min(deadline, budget)
    b = _Bounds(name, deadline, timeout, max_chars)
    if now > deadline:
        raise b.late()
    prev = _bounds()
    _LOCAL.bounds = b
    try:
        key = b.watchdog_key = _WATCHDOG.arm(deadline + WATCHDOG_GRACE_S)
        try:
            try:
                out: list[str] = []
                n = 0
                gen: Generator[str, None, None] = compiled.generate(**variables)  # pyright: ignore[reportAssignmentType]
                try:
                    for chunk in gen:
                        n += len(chunk)
                        if n > max_chars:
                            raise b.exceeded("output", f"more than {max_chars} characters")
                        out.append(chunk)
                        if time.monotonic() > deadline:
                            raise b.late()
                finally:
                    gen.close()
                return "".join(out)
            finally:
                _WATCHDOG.disarm(key)  # no interruption can land after this
        except _RenderInterrupted:
            raise b.late() from None
        except RecursionError:
            raise b.exceeded("nesting", "too deep a recursion") from None
    finally:
        _LOCAL.bounds = prev


def _has_think_token(folder: Path, config: Mapping[str, Any]) -> bool:
    """Whether the tokenizer knows ``<think>`` as an added token: the sign of a reasoning model."""
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        if any(_token_text(v) == THINK_OPEN for v in decoder.values()):
            return True
    tok = _read_json(folder / "tokenizer.json")
    added = tok.get("added_tokens")
    if isinstance(added, list):
        return any(isinstance(t, Mapping) and t.get("content") == THINK_OPEN for t in added)
    return False
