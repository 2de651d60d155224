"""gpt-oss's Harmony format: model text in, OpenAI deltas out, with the emitter's interface.

A Harmony prompt ends with ``<|start|>assistant``; what the model writes after it is a sequence of
messages, each a header, ``<|message|>``, a body and an end marker::

    <|channel|>analysis<|message|>Let me look it up.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or, ending the answer, ``<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>``. The
recipient (``to=functions.NAME``) may also stand in the role part of the header, before the channel
(``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``), as the template
renders past calls. Each message's body goes out as:

- ``analysis`` -> reasoning;
- a recipient (``to=X``, any channel) -> a tool call named ``X`` without its ``functions.``
  namespace, whose arguments are the body's JSON text as written (streamed as it comes, the
  surrounding whitespace dropped). With tools off (``tools_enabled=False``) the body is content;
- ``final``, ``commentary`` without a recipient (a preamble), no channel, or an unknown channel ->
  content.

Two messages of the same kind (two analysis messages, a preamble and a final answer) are joined
with a newline. Headers and markers are never emitted. The body ends at ``<|end|>``, ``<|return|>``,
``<|call|>`` or a ``<|start|>`` (a new message), and the end of the output or a stop string ends
it too (the part of an end marker the output ends inside is dropped, from two characters on, as
the emitter drops a cut ``<tool_call>``): a call cut off that way is returned as what it is (its name and its arguments so far),
never as markup in the content; a header cut off after a whole recipient name is a call with
empty arguments, any other cut-off header is dropped (text that only began like a role,
"assistant is here", is content).

Output that is not Harmony (a header that cannot begin as one, holds a newline, or runs past
:data:`MAX_HEADER` characters without ``<|message|>``) is content, as written, up to the next end
marker: a model that strays from the format still answers.

Stop strings (at most four) are matched in the messages' bodies, across piece boundaries, as the
emitter matches them (the match that completes first wins; nothing from it on is emitted;
:attr:`HarmonyParser.stopped` turns True); never in headers, so a stop string such as "final" does
not end the output at a channel name. A carry holds back the longest tail of a body that could
still become a marker or a stop string. The same text always gives the same deltas once they are
joined per kind, however it is split.

The markers are special tokens of gpt-oss's tokenizer: the detokenizer must keep their text
(:attr:`HarmonyParser.keep_special` names them; ``IncrementalDetokenizer(keep_special=...)``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .emitter import Delta, OutputScanner, first_match
from .tools import new_call_id

__all__ = ["FINAL_OPENING", "HARMONY_MARKERS", "HarmonyParser", "MAX_HEADER"]

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"

# Where the answer starts: a constrained output's grammar (``response_format``) starts here, so
# the model reasons first, as it was trained to (``grammar_after``).
FINAL_OPENING = CHANNEL + "final" + MESSAGE

# The special tokens whose text the parser reads (``<|endoftext|>`` and the reserved ones stay
# skipped by the detokenizer).
HARMONY_MARKERS = frozenset({START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL})

# A header is ``assistant to=functions.NAME<|channel|>commentary <|constrain|>json`` at most;
# OpenAI's function names are at most 64 characters, so a longer one is not a header.
MAX_HEADER = 256

# How a header not after a ``<|start|>`` can begin: the channel (the first message: the prompt
# holds the role), the recipient before the channel, or (after an ``<|end|>``) the role.
_OPENINGS = ("assistant", "<|", "to=")
_OPENING_LEN = max(map(len, _OPENINGS))  # a header this long either begins like one or never will
_BODY_ENDS = (END, RETURN, CALL, START)
_HEADER_EVENTS = (MESSAGE, *_BODY_ENDS)

_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
# A recipient name is whole once something follows it.
_WHOLE_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)(?:\s|<)")
_ROLES = frozenset({"assistant", "user", "system", "developer"})
# gpt-oss's built-in tools (its template's ``python``, ``browser.*``; ``container.*``): a message
# to one is no function call and no answer, dropped (as llama.cpp drops it)
_BUILTIN = re.compile(r"python$|browser\.|container\.")

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"

_DROPPED = "dropped"  # the body of a message to a built-in tool

_HEADER = "header"
_BODY = "body"


def _opens_header(text: str) -> bool:
    """Whether ``text`` (the header so far, leading whitespace dropped) can still begin one."""
    return any(text.startswith(o) or o.startswith(text) for o in _OPENINGS)


def _recipient(header: str, pattern: re.Pattern[str] = _RECIPIENT) -> str | None:
    """The header's recipient, unless it is a role (a message to the assistant is no call)."""
    m = pattern.search(header)
    if m is None or m.group(1) in _ROLES:
        return None
    return m.group(1)


def _call_name(recipient: str) -> str:
    return recipient.removeprefix("functions.") or recipient


class HarmonyParser(OutputScanner):
    """Splits a Harmony output into reasoning, content and tool calls; applies stop strings.

    The emitter's interface (:class:`pantheon.chat.emitter.Emitter`): :meth:`feed` each new piece
    of text, :meth:`finish` at the end, both returning the deltas that are final;
    :attr:`stopped`, :attr:`stop_string`, :attr:`tool_calls` (OpenAI-shaped) and
    :meth:`finish_reason` mean what they mean there. ``tools_enabled``: read calls (off: a call's
    body is content).
    """

    keep_special: frozenset[str] = HARMONY_MARKERS

    def __init__(self, *, stop: Iterable[str] = (), tools_enabled: bool = True):
        super().__init__(stop)
        self.tools_enabled = tools_enabled

        self._state = _HEADER
        self._buf = ""  # in a body: the carry; in a header: the header so far
        self._kind = CONTENT  # the open body's kind
        self._call: dict[str, Any] | None = None  # the open call (an entry of tool_calls)
        self._fresh = False  # the open body has emitted nothing yet
        self._role_next = False  # the header follows a <|start|>: it begins with a role
        self._had: set[str] = set()  # the kinds an earlier message emitted text of
        self._pending_ws = ""  # a call's trailing whitespace, held until more arguments come

    # -------------------------------------------------------------- the scanner

    def _step(self, final: bool) -> bool | None:
        return self._header_step(final) if self._state == _HEADER else None

    def _needles(self) -> list[tuple[str, bool]]:
        return [(s, True) for s in self._stops] + [(m, False) for m in _BODY_ENDS]

    def _marker(self, marker: str) -> None:
        self._close_message()
        self._role_next = marker == START

    def _header_step(self, final: bool) -> bool:
        """Read the header in the carry. Returns False while it is still open."""
        self._buf = self._buf.lstrip()
        header = self._buf
        # The event a left-to-right reader completes first: a marker, or the point where the
        # text stops being a header (it cannot begin as one, a newline, too long).
        events = [(m, False) for m in _HEADER_EVENTS]
        match = first_match(header, events)
        end = len(header) + 1 if match is None else match[0] + len(match[1])
        stray = (
            None
            if self._role_next  # after <|start|> any role may come (``functions.f`` answers)
            else next(
                (k for k in range(1, min(len(header), _OPENING_LEN) + 1) if not _opens_header(header[:k])),
                None,
            )
        )
        for cut in (
            stray,
            header.find("\n") + 1 or None,
            MAX_HEADER + 1 if len(header) > MAX_HEADER else None,
        ):
            if cut is not None and cut < end:
                end, match = cut, None
        if end <= len(header) and match is None:  # not Harmony: content, as written
            self._open(CONTENT)
            return True
        if match is None:
            if final and header:
                if not self._headerish(header):  # text that only began like a role
                    self._open(CONTENT)
                    return True
                self._cut_header(header)
                self._buf = ""
            return False
        start, marker, _ = match
        self._buf = header[start + len(marker) :]
        head = header[:start]
        if marker == START and not head:
            self._role_next = True  # the next message's opening
            return True
        self._open_from_header(head)
        if marker != MESSAGE:  # a message without a body
            self._close_message()
            self._role_next = marker == START
        return True

    def _headerish(self, header: str) -> bool:
        """Whether an output that ends in ``header`` (no ``<|message|>`` yet) ended inside a
        header: after a ``<|start|>``, with a marker or a recipient, or a role cut short
        (``assist``); "assistant is here" was text."""
        return (
            self._role_next
            or "<|" in header
            or "to=" in header
            or any(o.startswith(header) for o in _OPENINGS)
        )

    def _open_from_header(self, header: str) -> None:
        recipient = _recipient(header)
        if recipient is not None and _BUILTIN.match(recipient):
            self._open(_DROPPED)
            return
        if recipient is not None and self.tools_enabled:
            self._open_call(_call_name(recipient))
            return
        # the channel the message is in: the header's last (``commentary to=assistant`` may
        # come before the real one)
        channels = _CHANNEL.findall(header)
        self._open(REASONING if channels and channels[-1] == "analysis" else CONTENT)

    def _cut_header(self, header: str) -> None:
        """The output ended inside a header: a whole recipient name is a call (with no
        arguments yet); anything else is dropped."""
        recipient = _recipient(header, _WHOLE_RECIPIENT)
        if recipient is not None and self.tools_enabled and not _BUILTIN.match(recipient):
            self._open_call(_call_name(recipient))
            self._close_message()

    # -------------------------------------------------------------- messages

    def _open(self, kind: str) -> None:
        self._state, self._kind, self._fresh, self._role_next = _BODY, kind, True, False

    def _open_call(self, name: str) -> None:
        self._open(TOOL_CALL)
        index = len(self.tool_calls)
        call_id = new_call_id()
        self._call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        self.tool_calls.append(self._call)
        self._out.append(Delta(TOOL_CALL, index=index, id=call_id, name=name, arguments=""))

    def _text(self, text: str) -> None:
        """Body text of the open message."""
        if not text or self._kind == _DROPPED:
            return
        if self._kind == TOOL_CALL:
            if self._fresh:
                text = text.lstrip()
            if not text:
                return
            text = self._pending_ws + text
            body = text.rstrip()
            self._pending_ws = text[len(body) :]
            if body:
                self._fresh = False
                assert self._call is not None
                self._call["function"]["arguments"] += body
                self._out.append(Delta(TOOL_CALL, index=len(self.tool_calls) - 1, arguments=body))
            return
        if self._fresh:
            self._fresh = False
            if self._kind in self._had:
                text = "\n" + text
            self._had.add(self._kind)
        if self._out and self._out[-1].kind == self._kind:
            self._out[-1].text += text  # one delta per run keeps SSE chunks few
        else:
            self._out.append(Delta(self._kind, text=text))

    def _close_message(self) -> None:
        self._state, self._call, self._pending_ws, self._role_next = _HEADER, None, "", False

    def _end_of_text(self) -> None:
        """The output ended (its end or a stop string): an open body ends where it is."""
        if self._state == _BODY:
            self._close_message()
