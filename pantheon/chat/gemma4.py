"""Gemma 4's output format: model text in, OpenAI deltas out, with the emitter's interface.

Gemma 4's chat template (``../shared/specs/gemma-4-31B-it.chat_template.jinja``) writes a model
turn as optional thinking, tool calls and text::

    <|channel>thought
    Let me look it up.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

- ``<|channel>NAME\\n ... <channel|>`` -> reasoning (the channel's name, ``thought``, and the
  whitespace at the body's edges dropped, as the template writes them around it). Thinking is on
  when the template's ``enable_thinking`` is (it writes ``<|think|>`` into the system turn); off,
  the generation prompt closes an empty thought channel itself, so the output starts as content.
  Two thought blocks are joined with a newline.
- ``<|tool_call>call:NAME{ARGS}<tool_call|>`` -> a tool call. ``ARGS`` are in the template's own
  syntax (its ``format_argument`` macro), not JSON: bare keys, strings between ``<|"|>`` markers
  (nothing escaped inside), ``true``/``false``, numbers as Python writes them, ``None``, nested
  ``{...}`` and ``[...]``. :func:`gemma4_arguments` turns them back into a JSON arguments string,
  streamed as it grows (a call's first delta once its name is whole). Several calls may follow each
  other (or share one block). A call the output ends inside (``max_tokens``, a stop string), or
  that strays from the syntax, is returned as what it is: its name and the arguments so far as
  JSON text (``{"city": "Pa``, as OpenAI cuts arguments at ``length``); never markup in the
  content. A block in which not even a name was written is dropped, or, closed, is content as the
  model wrote it (the emitter's rule).
- the rest -> content, leading whitespace after a closed channel or call dropped.

``<|tool_response>`` (what follows a turn's calls: the tool's answer comes next) and ``<turn|>``
end the output (both are end tokens of the model; a vocabulary without them as tokens may still
write their text). The other markers of the format (``<|turn>``, ``<tool_response|>``, stray
closers, ``<|think|>``) are dropped wherever they appear: none leaks into the content.

Stop strings (at most four) are matched on the raw text in every part, across piece boundaries, as
the emitter matches them (the match that completes first wins; nothing from it on is emitted).
A carry holds back the longest tail that could still become a marker or a stop string. The same
text always gives the same deltas once they are joined per kind, however it is split.

The markers are special tokens of Gemma 4's tokenizer: the detokenizer must keep their text
(:attr:`Gemma4Parser.keep_special`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from .emitter import Delta, OutputScanner
from .tools import ParsedToolCall, new_call_id

__all__ = [
    "CALL_CLOSE",
    "CALL_OPEN",
    "CHANNEL_CLOSE",
    "CHANNEL_OPEN",
    "GEMMA4_MARKERS",
    "Gemma4Parser",
    "QUOTE",
    "gemma4_arguments",
    "read_gemma4_calls",
]

CHANNEL_OPEN = "<|channel>"
CHANNEL_CLOSE = "<channel|>"
CALL_OPEN = "<|tool_call>"
CALL_CLOSE = "<tool_call|>"
QUOTE = '<|"|>'  # a string's delimiter, both ends
RESPONSE_OPEN = "<|tool_response>"
RESPONSE_CLOSE = "<tool_response|>"
TURN_OPEN = "<|turn>"
TURN_CLOSE = "<turn|>"
THINK = "<|think|>"

# What ends the output: the tool's answer comes next, or the turn is over.
END_MARKERS = (RESPONSE_OPEN, TURN_CLOSE)
# The special tokens whose text the parser reads.
GEMMA4_MARKERS = frozenset(
    {
        CHANNEL_OPEN,
        CHANNEL_CLOSE,
        CALL_OPEN,
        CALL_CLOSE,
        QUOTE,
        RESPONSE_OPEN,
        RESPONSE_CLOSE,
        TURN_OPEN,
        TURN_CLOSE,
        THINK,
    }
)

# A channel's name (``thought``) is a word on the channel's first line (or right before a marker).
_CHANNEL_NAME = re.compile(r"[A-Za-z_]{1,32}(?:\n|(?=<))")
_MAX_CHANNEL_NAME = 33

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"

_CONTENT = "content"
_NAME = "channel name"
_THOUGHT = "thought"
_CALL = "call"


# ------------------------------------------------------------------ the argument syntax


class _Cut(Exception):
    """The text ended inside a value."""


class _Bad(Exception):
    """The text is not Gemma 4's argument syntax."""


_INT = re.compile(r"-?\d+")
_WORDS: dict[str, Any] = {
    "true": True,
    "false": False,
    "True": True,
    "False": False,
    "None": None,
    "none": None,
    "null": None,
}
_WORD_ENDS = ",}]:{["  # and whitespace: a bare word is one word


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _string(s: str, i: int, out: list[str]) -> int:
    """A ``<|"|>``-quoted string at ``i``; on a cut, its text so far (held back where the end
    could be the start of the closing marker)."""
    start = i + len(QUOTE)
    end = s.find(QUOTE, start)
    if end < 0:
        body = s[start:]
        body = body[
            : len(body) - next((k for k in range(len(QUOTE) - 1, 0, -1) if body.endswith(QUOTE[:k])), 0)
        ]
        out.append(json.dumps(body, ensure_ascii=False)[:-1])
        raise _Cut
    out.append(json.dumps(s[start:end], ensure_ascii=False))
    return end + len(QUOTE)


def _word(word: str) -> str:
    """A bare value (``format_argument``'s ``{{ argument }}``: numbers, and what a model may
    write unquoted) as JSON."""
    if word in _WORDS:
        return json.dumps(_WORDS[word])
    if _INT.fullmatch(word):
        return str(int(word))
    try:
        number = float(word)
    except ValueError:
        return json.dumps(word, ensure_ascii=False)  # an unquoted string
    if number != number or number in (float("inf"), float("-inf")):
        return json.dumps(word)
    return json.dumps(number)


def _value(s: str, i: int, out: list[str], depth: int = 0) -> int:
    if depth > 64:
        raise _Bad
    i = _skip_ws(s, i)
    if i >= len(s) or QUOTE.startswith(s[i:]):
        raise _Cut
    if s.startswith(QUOTE, i):
        return _string(s, i, out)
    c = s[i]
    if c == "{":
        return _members(s, i + 1, out, depth)
    if c == "[":
        out.append("[")
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            raise _Cut
        if s[i] == "]":
            out.append("]")
            return i + 1
        while True:
            i = _skip_ws(s, _value(s, i, out, depth + 1))
            if i >= len(s):
                raise _Cut
            if s[i] == "]":
                out.append("]")
                return i + 1
            if s[i] != ",":
                raise _Bad
            out.append(", ")
            i += 1
    end = i
    while end < len(s) and s[end] not in _WORD_ENDS and not s[end].isspace() and not s.startswith("<|", end):
        end += 1
    if end >= len(s):
        raise _Cut  # the word may go on: held back
    word = s[i:end]
    if not word:
        raise _Bad
    out.append(_word(word))
    return end


def _members(s: str, i: int, out: list[str], depth: int) -> int:
    """An object's members after its ``{``, up to and including its ``}``."""
    out.append("{")
    i = _skip_ws(s, i)
    if i >= len(s):
        raise _Cut
    if s[i] == "}":
        out.append("}")
        return i + 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s) or QUOTE.startswith(s[i:]):
            raise _Cut
        if s.startswith(QUOTE, i):  # a quoted key (``escape_keys``)
            end = s.find(QUOTE, i + len(QUOTE))
            if end < 0:
                raise _Cut
            key, i = s[i + len(QUOTE) : end], end + len(QUOTE)
            i = _skip_ws(s, i)
            if i >= len(s):
                raise _Cut
            if s[i] != ":":
                raise _Bad
        else:
            end = s.find(":", i)
            if end < 0:
                if any(ch in s[i:] for ch in "{}[],<"):
                    raise _Bad
                raise _Cut  # a key being written: held back
            key = s[i:end].strip()
            if not key or any(ch in key for ch in "{}[],<"):
                raise _Bad
            i = end
        out.append(json.dumps(key, ensure_ascii=False) + ": ")
        i = _skip_ws(s, _value(s, i + 1, out, depth + 1))
        if i >= len(s):
            raise _Cut
        if s[i] == "}":
            out.append("}")
            return i + 1
        if s[i] != ",":
            raise _Bad
        out.append(", ")
        i += 1


def gemma4_arguments(text: str) -> tuple[str, bool]:
    """The JSON of an arguments object in Gemma 4's syntax (``{city:<|"|>Paris<|"|>}``, from its
    ``{``), and whether it was whole. A cut-off one gives the JSON text so far (a key or a bare
    word still being written held back); text after the object is ignored. Raises ValueError when
    ``text`` is not that syntax.

    The JSON so far only grows as the text does (a key, a word, the start of a closing ``<|"|>``
    wait until they are whole), so a stream of it is the difference from the last."""
    out: list[str] = []
    i = _skip_ws(text, 0)
    if i >= len(text):
        return "", False
    if text[i] != "{":
        raise ValueError("Gemma 4 arguments start with '{'")
    try:
        _members(text, i + 1, out, 0)
    except _Cut:
        return "".join(out), False
    except _Bad:
        raise ValueError("not Gemma 4's argument syntax") from None
    return "".join(out), True


_CALL_HEAD = re.compile(r"\s*call:([^{}\s<]+)\s*(?=\{)")


def read_gemma4_calls(block: str) -> tuple[list[ParsedToolCall], bool]:
    """The calls in the inside of a ``<|tool_call>`` block (``call:NAME{ARGS}``, one or more),
    so far: each one whose name is whole (its ``{`` written) with its arguments' JSON so far
    (:func:`gemma4_arguments`), up to the end of the text or the first thing that is not that
    syntax (the call it stands in ends there, as it is); and whether every call read was whole
    and nothing else follows them (``<tool_call|>`` may come next)."""
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        while pos < len(block) and (block[pos].isspace() or block[pos] == ","):
            pos += 1
        if pos >= len(block):
            return calls, bool(calls)
        head = _CALL_HEAD.match(block, pos)
        if head is None:
            return calls, False
        out: list[str] = []
        try:
            pos = _members(block, head.end() + 1, out, 0)
        except (_Cut, _Bad):
            calls.append(ParsedToolCall(name=head.group(1), arguments="".join(out)))
            return calls, False
        calls.append(ParsedToolCall(name=head.group(1), arguments="".join(out)))


# ------------------------------------------------------------------ the parser


class Gemma4Parser(OutputScanner):
    """Splits a Gemma 4 output into reasoning, content and tool calls; applies stop strings.

    The emitter's interface (:class:`pantheon.chat.emitter.Emitter`): :meth:`feed` each new piece
    of text, :meth:`finish` at the end, both returning the deltas that are final;
    :attr:`stopped`, :attr:`stop_string`, :attr:`tool_calls` (OpenAI-shaped) and
    :meth:`finish_reason` mean what they mean there. ``tools_enabled``: read calls (off: a call
    block is content as written).
    """

    keep_special: frozenset[str] = GEMMA4_MARKERS

    def __init__(self, *, stop: Iterable[str] = (), tools_enabled: bool = True):
        super().__init__(stop)
        self.tools_enabled = tools_enabled

        self._state = _CONTENT
        self._buf = ""  # the carry
        self._block = ""  # the inside of the open call block
        self._block_calls: list[int] = []  # the indexes (in tool_calls) of its calls so far
        self._skip_ws = True  # drop leading whitespace of the next text
        self._pending_ws = ""  # trailing whitespace held in case a marker follows
        self._had_thought = False
        self._ended = False  # an end marker was read: nothing after it is output

    def _accepting(self) -> bool:
        return super()._accepting() and not self._ended  # nothing after an end marker is output

    # -------------------------------------------------------------- the scanner

    def _needles(self) -> list[tuple[str, bool]]:
        """The strings that change something in the current state, with whether each is a stop."""
        needles = [(s, True) for s in self._stops] + [(m, False) for m in END_MARKERS]
        if self._state == _CALL:
            return needles + [(CALL_CLOSE, False)]
        markers = [CHANNEL_OPEN, CHANNEL_CLOSE, TURN_OPEN, RESPONSE_CLOSE, THINK]
        if self.tools_enabled:  # (off, a call block is content as written, markers and all)
            markers += [CALL_OPEN, CALL_CLOSE, QUOTE]
        return needles + [(m, False) for m in markers]

    def _step(self, final: bool) -> bool | None:
        if self._ended:
            return False
        return self._channel_name(final) if self._state == _NAME else None

    def _channel_name(self, final: bool) -> bool:
        """After ``<|channel>``: drop the channel's name line. False while it is still open."""
        m = _CHANNEL_NAME.match(self._buf)
        if m is not None:
            self._buf = self._buf[m.end() :]
        elif not final and len(self._buf) < _MAX_CHANNEL_NAME and re.fullmatch(r"[A-Za-z_]*", self._buf):
            return False  # the name may go on
        elif final and re.fullmatch(r"[A-Za-z_]*", self._buf):
            self._buf = ""  # the output ended in the name
        self._state = _THOUGHT
        self._skip_ws = True
        return True

    # -------------------------------------------------------------- what the scanner found

    def _marker(self, marker: str) -> None:
        if marker in END_MARKERS:
            self._buf = ""
            self._end_of_text()
            self._ended = True
        elif marker == CHANNEL_OPEN:
            # (one inside a thought is dropped; but one repeated before the thought said
            # anything opens it again: its name follows)
            if self._state == _CONTENT or (self._state == _THOUGHT and self._skip_ws):
                self._pending_ws = ""
                self._state = _NAME
        elif marker == CHANNEL_CLOSE:
            if self._state == _THOUGHT:
                self._pending_ws = ""
                self._state = _CONTENT
                self._skip_ws = True
        elif marker == CALL_OPEN:  # (in a thought too: the call ends it)
            self._pending_ws = ""
            self._state = _CALL
            self._block, self._block_calls = "", []
        elif marker == CALL_CLOSE and self._state == _CALL:
            self._state = _CONTENT
            self._close_call(closed=True)
        # anything else: dropped markup

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._state == _CALL:
            self._block += text
            self._read_block()
            return
        kind = REASONING if self._state == _THOUGHT else CONTENT
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
            if kind == REASONING:
                if self._had_thought:
                    text = "\n" + text
                self._had_thought = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        if body:
            self._emit(kind, body)

    def _read_block(self) -> None:
        """Stream the open block's calls: a call's first delta once its name is whole, then its
        arguments' JSON as it grows."""
        calls, _ = read_gemma4_calls(self._block)
        self._stream_calls(calls, self._block_calls, new_call_id)

    def _close_call(self, *, closed: bool) -> None:
        """The block ended (``<tool_call|>``, or the output: ``closed`` False). Its calls went
        out as they came; a closed block in which no call was read is content, as written."""
        if not self._block_calls and closed:
            raw = CALL_OPEN + self._block + CALL_CLOSE
            self._block = ""
            self._skip_ws = False
            self._text(raw)
            return
        self._block, self._block_calls = "", []
        self._skip_ws = True

    def _end_of_text(self) -> None:
        """The output ended (its end, an end marker or a stop string): settle what is open."""
        if self._state == _CALL:
            self._state = _CONTENT
            self._close_call(closed=False)
        if self._state == _CONTENT and self._pending_ws and self.stopped:
            self._emit(CONTENT, self._pending_ws)
        elif self._state == _THOUGHT and self._pending_ws and self.stopped:
            self._emit(REASONING, self._pending_ws)
        self._pending_ws = ""

    # -------------------------------------------------------------- output

    def _emit(self, kind: str, text: str) -> None:
        if self._out and self._out[-1].kind == kind:
            self._out[-1].text += text  # one delta per run keeps SSE chunks few
        else:
            self._out.append(Delta(kind, text=text))
