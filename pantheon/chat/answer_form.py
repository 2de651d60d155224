"""Call or reply: ``tool_choice: "auto"`` on a model whose chat template takes no tools.

Such a template (SmolLM2's) renders no ``tools``, so the router lists them in the system message
itself (:mod:`pantheon.chat.tools`). Under ``required`` or a named function the call is forced
with a grammar in the ``<tool_call>`` form; under ``auto`` a model that was never trained on
tools simply answers in prose (SmolLM2-135M did on every prompt tried). So, as llama.cpp's
server does for templates without a native tool format (its "generic" handler), the answer is
one JSON object in a form the grammar enforces (``structured.call_or_reply_grammar``)::

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}    (unless parallel_tool_calls is false)
    {"response": "It is sunny."}

so the model's one free decision is the key after ``{"``: call or reply. That is ``--tool-auto
decide``. The default, ``lazy``, lets the answer also be prose from its first token (the grammar's
``prose``), as llama.cpp's tool grammars are lazy: an answer that opens with ``{`` is held to the
forms, any other is the model's text; SmolLM2-135M then answers every prompt in
``bench/tool_auto.py`` in prose, as llama-server does with this file, and calls a tool only
where a client pushes it to (issue 40 section 5). :func:`with_answer_prompt`
writes the prompt (the tools and this form) and rewrites the conversation's past assistant turns
into the form (a call it made as ``{"tool_call": ...}``, a reply as ``{"response": ...}``), so
the model sees its own history as it would have written it, and after the results of its calls
a line that asks for the reply (:data:`AFTER_RESULTS`: a small model otherwise calls again). :class:`AnswerReader` maps the
answer back: ``response``'s string becomes content deltas as its characters arrive (JSON
escapes decoded, an escape split across pieces held until whole), ``tool_call(s)`` become tool
calls when the object closes (or, cut off by ``max_tokens``, what there is of them: the calls
finished and the last one's name and arguments so far, as the emitter does for ``<tool_call>``
blocks). :class:`CallOrReply` puts the emitter in front, for stop strings and a reasoning
model's ``<think>`` block (the grammar starts after it). However the text is split, the joined
deltas are the same; streamed and collected responses are made from the same deltas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .emitter import CONTENT, TOOL_CALL, Delta, Emitter
from .tools import TOOLS_PREAMBLE, new_call_id, parse_tool_block, parse_unfinished_tool_block

__all__ = [
    "AFTER_RESULTS",
    "AnswerReader",
    "CallOrReply",
    "answer_prompt",
    "past_answer",
    "with_answer_prompt",
]

REPLY_KEY = "response"
CALL_KEY = "tool_call"
CALLS_KEY = "tool_calls"

# the opening of each form, without whitespace (the grammar writes none; a model may)
_HEADS = {'{"response":"': REPLY_KEY, '{"tool_call":': CALL_KEY, '{"tool_calls":': CALLS_KEY}

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_PLAIN = re.compile(r'[^"\\]+')


# After the results of its calls, a small model copies the form of its own previous turn and calls
# again: SmolLM2-135M, greedy, calls get_weather for Paris forever (pydantic-ai stops it at its
# request limit). This line after the results turns it to a reply (the logprob of "response"
# over "tool" after ``{"``: -3.3 without it, +2.5 with it; as the last tool message's own text
# +0.0, too weak). The grammar still allows a call; a template that refuses a system message
# there is rendered without it (pantheon.control.context).
AFTER_RESULTS = 'Answer with {"response": ...} now unless another function is needed.'


def answer_prompt(tools: Sequence[Mapping[str, Any]], *, parallel: bool = True) -> str:
    """The tools' definitions (one JSON object a line, as the generic tool prompt lists them) and
    the call-or-reply answer form."""
    listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    several = ', or {"tool_calls": [<call>, <call>, ...]} to call several at once' if parallel else ""
    return (
        TOOLS_PREAMBLE
        + listing
        + "\n</tools>\n\nAnswer with one JSON object: either "
        + '{"tool_call": {"name": <function-name>, "arguments": <args-json-object>}} to call a function'
        + several
        + ', or {"response": <your answer to the user, as a string>} to answer directly.'
    )


def past_answer(message: Mapping[str, Any]) -> str:
    """An assistant message as the answer form writes it: its tool calls (arguments as a dict
    or as JSON text) as ``{"tool_call": ...}`` or ``{"tool_calls": [...]}``, else its content as
    ``{"response": ...}``."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # kept as the text the client sent
        calls.append({"name": fn.get("name", ""), "arguments": args})
    if len(calls) == 1:
        return json.dumps({CALL_KEY: calls[0]}, ensure_ascii=False)
    if calls:
        return json.dumps({CALLS_KEY: calls}, ensure_ascii=False)
    return json.dumps({REPLY_KEY: message.get("content") or ""}, ensure_ascii=False)


def with_answer_prompt(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    *,
    parallel: bool = True,
    nudge: bool = True,
) -> list[dict]:
    """``messages`` with :func:`answer_prompt` in the system message (after a leading system
    message's text and a blank line, else as a new first message) and every assistant turn
    rewritten by :func:`past_answer`. With ``nudge``, a conversation that ends in tool results
    gets :data:`AFTER_RESULTS` after them as a system message (see there)."""
    prompt = answer_prompt(tools, parallel=parallel)
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant":
            m["content"] = past_answer(m)
            m.pop("tool_calls", None)
        out.append(m)
    if nudge and out and out[-1].get("role") == "tool":
        out.append({"role": "system", "content": AFTER_RESULTS})
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        text = out[0]["content"]
        out[0]["content"] = f"{text}\n\n{prompt}" if text else prompt
        return out
    return [{"role": "system", "content": prompt}, *out]


# ---------------------------------------------------------------- reading the answer back

_HEAD = "head"  # which form: not decided yet
_REPLY = "reply"  # inside the response string
_CALLS = "calls"  # inside tool_call(s), read when the object closes
_DONE = "done"  # the answer is over; what follows is dropped
_RAW = "raw"  # not the form at all: everything is content as written


class AnswerReader:
    """Call-or-reply JSON in (in pieces of any size), deltas out (see the module doc).

    :meth:`feed` returns the deltas final now, :meth:`finish` the rest at the end of the
    output. Text that does not open one of the forms (the grammar was not in force) is content
    as written; an answer that ends before its form was even decided gives nothing."""

    def __init__(self) -> None:
        self._state = _HEAD
        self._buf = ""  # _HEAD: the text so far; _REPLY: an unfinished escape; _CALLS: the value
        self._key = ""
        self._opening = ""  # the text that opened the calls form, content again if they are not calls
        self._calls = 0
        self._out: list[Delta] = []

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, text: str) -> list[Delta]:
        if text and self._state != _DONE:
            self._buf += text
            self._step()
        return self._take()

    def finish(self) -> list[Delta]:
        if self._state == _CALLS:
            body = self._buf.strip()
            if self._key == CALLS_KEY:
                body = body.removeprefix("[").lstrip()
            self._calls_out(parse_unfinished_tool_block(body))
        elif self._state == _RAW:
            self._content(self._buf)
        # _HEAD: a form not even decided; _REPLY: an escape cut off: nothing to show of either
        self._state, self._buf = _DONE, ""
        return self._take()

    # ------------------------------------------------------------ the states

    def _step(self) -> None:
        if self._state == _HEAD:
            self._head()
        if self._state == _REPLY:
            self._reply()
        elif self._state == _CALLS:
            self._calls_in()
        elif self._state == _RAW:
            self._content(self._buf)
            self._buf = ""

    def _head(self) -> None:
        squeezed = ""
        for used, ch in enumerate(self._buf, 1):
            if not ch.isspace():
                squeezed += ch
            key = _HEADS.get(squeezed)
            if key is not None:
                self._key, self._opening = key, self._buf[:used]
                self._buf = self._buf[used:]
                self._state = _REPLY if key == REPLY_KEY else _CALLS
                return
        if not any(head.startswith(squeezed) for head in _HEADS):
            self._state = _RAW

    def _reply(self) -> None:
        """Decode the response string as far as it is whole."""
        buf, i, out = self._buf, 0, []
        while i < len(buf):
            m = _PLAIN.match(buf, i)
            if m is not None:
                out.append(m.group())
                i = m.end()
                continue
            if buf[i] == '"':  # the string's end: the answer is over
                self._state = _DONE
                i = len(buf)
                break
            char, size = _escape(buf, i)
            if size == 0:  # cut off: wait for the rest
                break
            out.append(char)
            i += size
        self._buf = buf[i:]
        self._content("".join(out))

    def _calls_in(self) -> None:
        """The value is whole once the object holding it closes: at a ``}`` that ends it."""
        if "}" not in self._buf:
            return
        try:
            value, end = json.JSONDecoder().raw_decode(self._buf.lstrip())
        except ValueError:
            return
        rest = self._buf.lstrip()[end:].lstrip()
        if not rest.startswith("}"):
            return  # the outer object is still open (a model may write more; the grammar does not)
        calls = parse_tool_block(json.dumps(value, ensure_ascii=False))
        if calls is None:  # not calls after all: content as written
            self._state, self._buf = _RAW, self._opening + self._buf
            self._content(self._buf)
            self._buf = ""
            return
        self._calls_out(calls)
        self._state, self._buf = _DONE, ""

    # ------------------------------------------------------------ output

    def _calls_out(self, calls: Iterable[Any]) -> None:
        for call in calls:
            call_id = new_call_id()
            self._out.append(Delta(TOOL_CALL, index=self._calls, id=call_id, name=call.name, arguments=""))
            self._out.append(Delta(TOOL_CALL, index=self._calls, arguments=call.arguments))
            self._calls += 1

    def _content(self, text: str) -> None:
        if not text:
            return
        if self._out and self._out[-1].kind == CONTENT:
            self._out[-1].text += text
        else:
            self._out.append(Delta(CONTENT, text=text))

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out


def _escape(buf: str, i: int) -> tuple[str, int]:
    """The character of the JSON escape at ``buf[i]`` (a backslash) and its length; length 0
    while it is cut off. A lone surrogate is U+FFFD (it cannot be written as UTF-8)."""
    if i + 1 >= len(buf):
        return "", 0
    kind = buf[i + 1]
    code = _hex4(buf, i + 2) if kind == "u" else -1
    if code is None:
        return "", 0
    if code < 0:  # a one-letter escape (or a malformed one, taken as its letter)
        return _ESCAPES.get(kind, kind), 2
    if not 0xD800 <= code <= 0xDFFF:
        return chr(code), 6
    if code >= 0xDC00:
        return "\ufffd", 6
    # a high surrogate: its low half must follow as another \\uXXXX
    tail = buf[i + 6 : i + 8]
    if len(tail) < 2 and "\\u".startswith(tail):
        return "", 0
    low = _hex4(buf, i + 8) if tail == "\\u" else -1
    if low is None:
        return "", 0
    if 0xDC00 <= low <= 0xDFFF:
        return chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)), 12
    return "\ufffd", 6


def _hex4(buf: str, i: int) -> int | None:
    """The four hex digits at ``buf[i:]`` as a number; None while cut off, -1 when not hex."""
    digits = buf[i : i + 4]
    if not all(c in "0123456789abcdefABCDEF" for c in digits):
        return -1
    return int(digits, 16) if len(digits) == 4 else None


class CallOrReply:
    """The output of a call-or-reply answer: the emitter first (stop strings, a reasoning
    model's ``<think>`` block; tool markup off), its content through an :class:`AnswerReader`.
    Same interface as the emitter (``feed``, ``finish``, ``stopped``)."""

    keep_special: frozenset[str] = frozenset()  # its markup is plain JSON text

    def __init__(self, *, reasoning: bool, stop: Iterable[str] = (), think_open: bool = False):
        self._emitter = Emitter(reasoning=reasoning, stop=stop, tools_enabled=False, think_open=think_open)
        self._reader = AnswerReader()

    @property
    def stopped(self) -> bool:
        return self._emitter.stopped

    def feed(self, text: str) -> list[Delta]:
        out = self._route(self._emitter.feed(text))
        if self._emitter.stopped:  # a stop string ended the text
            out += self._reader.finish()
        return out

    def finish(self) -> list[Delta]:
        return self._route(self._emitter.finish()) + self._reader.finish()

    def _route(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            out += self._reader.feed(d.text) if d.kind == CONTENT else [d]
        return out
