"""The emitter: model text in, OpenAI deltas out (reasoning, content, tool calls), stop strings.

Text arrives in arbitrary pieces (whatever the detokenizer made final). The emitter splits it into
channels as the spec describes:

- *reasoning*: everything before ``</think>`` when the prompt left a ``<think>`` open
  (``think_open``) or the output itself starts with ``<think>``. The markers are never emitted.
- *content*: the rest, up to a stop string or a ``<tool_call>``.
- *tool calls*: the inside of ``<tool_call>`` ... ``</tool_call>``, read when the block closes, in
  the model's format (``tool_format``): JSON (:func:`pantheon.chat.tools.parse_tool_block`) or
  Qwen3.5's XML (:func:`pantheon.chat.xml_tools.parse_xml_tool_block`, which types the values by
  the request's ``tools``). A format that can (``ToolFormat.stream``: the JSON ones) streams each
  call while its block is written: its first delta once its name is read, then its arguments' JSON
  as it grows; the block's parse then only adds what is left. A closed block that does not parse
  and streamed nothing is content again, written out as the model wrote it. A block the output ends inside (``max_tokens``, a stop string) is never markup in
  the content: its calls are returned as what they are, the last one cut off (its name and its
  arguments so far: :func:`pantheon.chat.tools.parse_unfinished_tool_block`), or nothing when
  not even a name was written; an output ending inside the ``<tool_call>`` marker itself drops
  that part of it (two characters or more: a lone ``<`` stays content). Streamed and not, the caller gets the same deltas.

Stop strings (at most four) are matched on the raw text, in every channel, across piece boundaries;
a match is never emitted, everything after it is dropped, and :attr:`Emitter.stopped` turns True so
the caller can abort the request. When two matches overlap, the one that completes first wins, which
is what a streaming reader sees, so the result never depends on how the text was split.

A carry buffer holds back the longest tail of the text that could still become a marker or a stop
string; all other text goes out at once. Whitespace is tidied at channel edges the way chat
templates render it back (Qwen's ``<think>\\n...\\n</think>\\n\\n``): leading whitespace after
``<think>``, ``</think>`` and ``</tool_call>`` is dropped, and trailing whitespace before
``</think>`` or ``<tool_call>`` too. Within a channel nothing is changed.

The same text always gives the same deltas once they are joined per channel, however it is split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .tools import JSON_TOOL_FORMAT, ParsedToolCall

if TYPE_CHECKING:
    from .toolformats import ToolFormat

__all__ = ["Delta", "Emitter", "MAX_STOP", "THINK_CLOSE", "THINK_OPEN", "finish_reason", "join_deltas"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# OpenAI allows up to four stop sequences; the HTTP layer answers more with a 400.
MAX_STOP = 4

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"

# Emitter states.
_START = "start"  # a reasoning model's first characters: is there a <think>?
_THINK = "think"
_CONTENT = "content"
_TOOL = "tool"


@dataclass
class Delta:
    """One piece of output.

    ``kind`` is "reasoning" or "content" (with ``text``), or "tool_call". A tool call comes as
    a first delta with its ``index`` (0, 1, ... in the response), ``id`` (``call_`` + 24 letters and
    digits), ``name`` and ``arguments=""``, then deltas with the same ``index`` carrying fragments
    of ``arguments`` (JSON text), exactly like OpenAI's stream chunks.
    """

    kind: str
    text: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def finish_reason(tool_calls_emitted: bool, reason: str) -> str:
    """The ``finish_reason`` to report: "tool_calls" once a tool call went out, else ``reason``."""
    return "tool_calls" if tool_calls_emitted else reason


def first_match(buf: str, needles: Sequence[tuple[str, bool]]) -> tuple[int, str, bool] | None:
    """The match of ``needles`` (each a string and whether it is a stop string) in ``buf`` that a
    left-to-right reader completes first: earliest end, then earliest start (the longer string),
    then a stop string before a marker. Returns (start, needle, is_stop) or None."""
    best = None
    for needle, is_stop in needles:
        i = buf.find(needle)
        if i < 0:
            continue
        key = (i + len(needle), i, not is_stop)
        if best is None or key < best[0]:
            best = (key, i, needle, is_stop)
    return None if best is None else best[1:]


def carry_len(buf: str, needles: Sequence[tuple[str, bool]]) -> int:
    """Length of the longest tail of ``buf`` that is the start of some needle: the carry."""
    longest = min(len(buf), max((len(n) - 1 for n, _ in needles), default=0))
    for k in range(longest, 0, -1):
        tail = buf[-k:]
        if any(n.startswith(tail) for n, _ in needles):
            return k
    return 0


class OutputScanner:
    """What every output parser shares (the emitter, Harmony's, Gemma 4's): text in through
    :meth:`feed` (the deltas final now), :meth:`finish` at the end, :meth:`finish_reason`; the
    stop strings checked once; :attr:`stopped`, :attr:`stop_string`, :attr:`tool_calls`
    (OpenAI-shaped, for non-streamed responses). A parser scans the carry ``_buf`` in
    ``_process(final=...)``, settles what is open in ``_end_of_text()``, and emits into ``_out``.
    """

    # The special tokens whose text the detokenizer must keep for this parser (none: markers are
    # ordinary added tokens; Harmony's and Gemma 4's parsers name theirs).
    keep_special: frozenset[str] = frozenset()

    def __init__(self, stop: Iterable[str] = ()):
        stops = list(dict.fromkeys(s for s in (stop or ()) if s))
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        self._stops = tuple(stops)
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched
        self.finished = False
        self.tool_calls: list[dict[str, Any]] = []
        self._buf = ""  # the carry: raw text not yet decided
        self._out: list[Delta] = []

    def _accepting(self) -> bool:
        """Whether more text can still change the output."""
        return not (self.stopped or self.finished)

    def feed(self, text: str) -> list[Delta]:
        """Add model text; return the deltas that are final now."""
        if not self._accepting() or not text:
            return []
        self._buf += text
        self._process(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """End of output: decide the carry, settle what is open; return the last deltas."""
        if self.finished:
            return []
        self.finished = True
        if not self.stopped:
            self._process(final=True)
            self._end_of_text()
        return self._take()

    def finish_reason(self, reason: str) -> str:
        """Return "tool_calls" if this output made any tool call, else ``reason``."""
        return finish_reason(bool(self.tool_calls), reason)

    def _process(self, *, final: bool) -> None:
        """Scan the carry: a parser's own step first (``_step``: a part read its own way, such
        as a header), then the first of ``_needles()`` in it: the text before it is emitted
        (``_text``), a stop string stops, a marker goes to ``_marker``. With none, emit all but
        what could still begin a needle; at the end, all but a marker the output was cut in
        (``_cut_marker``: markup, not text)."""
        while not self.stopped:
            step = self._step(final)
            if step is False:
                return
            if step:
                continue
            needles = self._needles()
            match = first_match(self._buf, needles)
            if match is not None:
                start, needle, is_stop = match
                self._text(self._buf[:start])
                self._buf = self._buf[start + len(needle) :]
                if is_stop:
                    self._stop(needle)
                    return
                self._marker(needle)
                continue
            if final:
                self._buf = self._buf[: len(self._buf) - self._cut_marker(needles)]
            keep = 0 if final else carry_len(self._buf, needles)
            self._text(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return

    def _step(self, final: bool) -> bool | None:
        """A parser's own reading of the carry before the needles: None when the state has none,
        True when it read something (scan again), False while it waits for more text."""
        return None

    def _cut_marker(self, needles: Sequence[tuple[str, bool]]) -> int:
        """How many characters at the end of the carry begin one of the markers (2 or more)."""
        markers = [n for n, is_stop in needles if not is_stop]
        return max((k for m in markers for k in range(2, len(m)) if self._buf.endswith(m[:k])), default=0)

    def _stop(self, stop: str) -> None:
        self.stopped = True
        self.stop_string = stop
        self._buf = ""
        self._end_of_text()

    def _needles(self) -> list[tuple[str, bool]]:
        """The strings that change something in the current state, with whether each is a stop."""
        raise NotImplementedError

    def _text(self, text: str) -> None:
        raise NotImplementedError

    def _marker(self, marker: str) -> None:
        raise NotImplementedError

    def _end_of_text(self) -> None:
        raise NotImplementedError

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _stream_calls(
        self, calls: Sequence[ParsedToolCall], sent: list[int], new_id: Callable[[], str]
    ) -> None:
        """Stream the calls of an open block, read so far (``calls``: each one's name, its
        model-given id, and its arguments' JSON so far, which only grows): a call's first delta
        once it appears, then its arguments' growth. ``sent`` holds the indexes (in
        :attr:`tool_calls`) of the block's calls that went out; it grows here."""
        for k, call in enumerate(calls):
            if k == len(sent):
                index, call_id = len(self.tool_calls), call.id or new_id()
                fn = {"name": call.name, "arguments": ""}
                self.tool_calls.append({"id": call_id, "type": "function", "function": fn})
                sent.append(index)
                self._out.append(Delta(TOOL_CALL, index=index, id=call_id, name=call.name, arguments=""))
            index = sent[k]
            fn = self.tool_calls[index]["function"]
            done = fn["arguments"]
            if len(call.arguments) > len(done) and call.arguments.startswith(done):
                more = call.arguments[len(done) :]
                fn["arguments"] = call.arguments
                last = self._out[-1] if self._out else None
                if last is not None and last.kind == TOOL_CALL and last.index == index and last.id is None:
                    last.arguments = (last.arguments or "") + more  # one delta per piece
                else:
                    self._out.append(Delta(TOOL_CALL, index=index, arguments=more))


class Emitter(OutputScanner):
    """Splits a model's output text into reasoning, content and tool calls; applies stop strings.

    ``reasoning``: the model may open its output with ``<think>`` (Qwen3 and the like).
    ``think_open``: the prompt already ends inside ``<think>``, so output starts as reasoning.
    ``stop``: up to :data:`MAX_STOP` stop strings (empty ones are ignored).
    ``tools_enabled``: read tool calls (off: their markup is plain content).
    ``tool_format``: the model's format (a :class:`~pantheon.chat.toolformats.ToolFormat` or its
    name, ``ChatTemplate.tool_format``): the markers that open and close a call block, how the
    answer's start reads, how a block's calls read, the reasoning markers;
    ``tools``: the request's tool definitions, whose schemas type the XML format's values.

    Call :meth:`feed` with each new piece of text and :meth:`finish` at the end; both return the
    deltas that are now final. After a stop string matched, :attr:`stopped` is True, and further
    feeding returns nothing.
    """

    def __init__(
        self,
        *,
        reasoning: bool,
        stop: Iterable[str] = (),
        tools_enabled: bool = True,
        think_open: bool = False,
        tool_format: ToolFormat | str = JSON_TOOL_FORMAT,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ):
        super().__init__(stop)
        from .toolformats import get

        fmt = get(tool_format) if isinstance(tool_format, str) else tool_format
        self._fmt = fmt
        self.tool_format = fmt.name
        self.keep_special = fmt.keep_special
        self.reasoning = reasoning
        self.tools_enabled = tools_enabled
        self._tools = list(tools or ())
        self._think_open, self._think_close = fmt.think or (THINK_OPEN, THINK_CLOSE)
        self._opener = ""  # the marker that opened the current call block
        self._lead_pending = tools_enabled  # the answer's start not read yet (ToolFormat.lead)

        self._state = _THINK if think_open else (_START if reasoning else _CONTENT)
        self._skip_ws = think_open  # drop leading whitespace of the next channel text
        self._pending_ws = ""  # trailing whitespace held in case a channel edge follows
        self._tool_raw = ""  # the inside of the open <tool_call> block
        self._block_calls: list[int] = []  # the indexes (in tool_calls) of its calls streamed so far
        self._ws_before_tool = ""  # whitespace dropped before <tool_call>, restored if it is not a call

    # -------------------------------------------------------------- the scanner

    def _needles(self) -> list[tuple[str, bool]]:
        """The strings that change something in the current state, with whether each is a stop."""
        needles = [(s, True) for s in self._stops]
        if self._state == _THINK:
            needles.append((self._think_close, False))
            if self.tools_enabled:
                needles += [(m, False) for m in self._fmt.ends_thinking]
        elif self._state == _CONTENT and self.tools_enabled:
            needles += [(m, False) for m in self._fmt.opens]
        elif self._state == _TOOL:
            close = self._close_marker()
            if close is not None:
                needles.append((close, False))
        return needles

    def _close_marker(self) -> str | None:
        return self._fmt.close_of(self._opener)

    def _step(self, final: bool) -> bool | None:
        if self._state == _START:
            return self._decide_start(final)
        if self._state == _CONTENT and self._lead_pending:
            return self._read_lead(final)
        return None

    def _read_lead(self, final: bool) -> bool:
        """The answer's first characters, read the format's way (``ToolFormat.lead``): a call
        that needs no marker (Llama 3's JSON), a recipient line (Functionary's), or content."""
        lead = self._fmt.lead(self._buf, final)
        if lead is None:
            return False
        self._lead_pending = False
        self._buf = self._buf[lead.skip :]
        if lead.call:
            self._state = _TOOL
            self._opener = lead.opener
            self._tool_raw = ""
            self._block_calls = []
        return True

    def _cut_marker(self, needles: Sequence[tuple[str, bool]]) -> int:
        # the output ended inside a marker itself (``<tool_ca``): markup, not content
        if self._state != _CONTENT or not self.tools_enabled:
            return 0
        return max(
            (k for m in self._fmt.opens for k in range(2, len(m)) if self._buf.endswith(m[:k])), default=0
        )

    def _decide_start(self, final: bool) -> bool:
        """A reasoning model's output may begin (after whitespace) with ``<think>``. Returns False
        while the carry could still turn out to be that marker."""
        opening = self._think_open
        body = self._buf.lstrip()
        if not final and (opening.startswith(body) and body != opening):
            return False
        lead = len(self._buf) - len(body)
        marker_end = lead + len(opening)
        # A stop string completed before the marker did comes first: that text is content.
        stop_first = first_match(self._buf[:marker_end], [(s, True) for s in self._stops])
        if body.startswith(opening) and stop_first is None:
            self._buf = self._buf[marker_end:]
            self._state = _THINK
            self._skip_ws = True
        else:
            self._state = _CONTENT
        return True

    # -------------------------------------------------------------- what the scanner found

    def _text(self, text: str) -> None:
        """Text that belongs to the current state."""
        if not text:
            return
        if self._state == _TOOL:
            self._tool_raw += text
            # the calls so far (ToolFormat.stream): names and arguments as they are written
            calls = self._fmt.stream(self._opener, self._tool_raw, self._tools)
            self._stream_calls(calls, self._block_calls, self._fmt.new_id)
            return
        kind = REASONING if self._state == _THINK else CONTENT
        if self._skip_ws:
            text = text.lstrip()
            if not text:
                return
            self._skip_ws = False
        # Trailing whitespace waits only where a marker could follow and swallow it.
        edge_possible = self._state == _THINK or self.tools_enabled
        if not edge_possible:
            self._emit(kind, text)
            return
        self._lead_pending = False
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        if body:
            self._emit(kind, body)

    def _marker(self, marker: str) -> None:
        if self._state == _THINK and marker != self._think_close:
            # a call opens in the reasoning (``ToolFormat.ends_thinking``): the reasoning ends there
            self._pending_ws = ""
            self._state = _CONTENT
        if self._state == _THINK:
            self._pending_ws = ""
            self._state = _CONTENT
            self._skip_ws = True
        elif self._state == _CONTENT:
            self._lead_pending = False
            self._ws_before_tool, self._pending_ws = self._pending_ws, ""
            self._state = _TOOL
            self._opener = marker
            self._tool_raw = ""
            self._block_calls = []
        elif self._state == _TOOL:
            self._state = _CONTENT
            if self._close_tool(closed=True):
                self._skip_ws = True

    def _end_of_text(self) -> None:
        """End of the text (stop string or finish): settle what is still open."""
        if self._state == _TOOL:
            self._state = _CONTENT
            # a block that runs to the end of the output (Mistral's, Llama 3's) is whole here
            # unless a stop string cut it
            self._close_tool(closed=self._close_marker() is None and not self.stopped)
        if self._state == _CONTENT and self._pending_ws:
            self._emit(CONTENT, self._pending_ws)
        elif self._state == _THINK and self._pending_ws and self.stopped:
            self._emit(REASONING, self._pending_ws)
        self._pending_ws = ""

    def _close_tool(self, *, closed: bool) -> bool:
        """Turn the finished tool block into calls; True if it was one. A closed block that does
        not parse is content as written; one cut off by a stop or the end is what it holds (see
        the module doc), never markup in the content."""
        fmt, opener, body = self._fmt, self._opener, self._tool_raw
        close = self._close_marker()
        calls = fmt.parse(opener, body, self._tools)
        if calls is None and (not closed or close is None):
            # cut off (a block to the end of the output may be, at max_tokens): what it holds,
            # and for the latter, content as written when it holds nothing
            calls = fmt.parse_unfinished(opener, body, self._tools)
            if not calls and closed:
                calls = None
        sent = self._block_calls
        if sent:
            # calls went out as the block was written: it is theirs, whatever follows, and each
            # one's arguments end as the stream read them where the parse read them otherwise
            # (the last of a block cut off: the parse gives the text, the stream its JSON)
            streamed = fmt.stream(opener, body, self._tools)
            done = [self.tool_calls[i]["function"]["arguments"] for i in sent]
            calls = [
                c if k >= len(sent) or c.arguments.startswith(done[k]) else streamed[k]
                for k, c in enumerate(calls or streamed)
            ]
        if calls is None:
            raw = self._ws_before_tool + opener + body + ((close or "") if closed else "")
            self._tool_raw = self._ws_before_tool = ""
            self._skip_ws = False
            self._text(raw)
            return False
        self._stream_calls(calls, sent, fmt.new_id)
        self._tool_raw = self._ws_before_tool = ""
        self._block_calls = []
        return True

    # -------------------------------------------------------------- output

    def _emit(self, kind: str, text: str) -> None:
        if self._out and self._out[-1].kind == kind and kind != TOOL_CALL:
            self._out[-1].text += text  # one delta per channel run keeps SSE chunks few
        else:
            self._out.append(Delta(kind, text=text))


def join_deltas(deltas: Iterable[Delta]) -> dict[str, Any]:
    """Fold deltas into one message: ``{"reasoning": str, "content": str, "tool_calls": [...]}``
    (OpenAI-shaped tool calls, arguments fragments joined), for non-streamed responses and tests."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.kind == REASONING:
            reasoning.append(d.text)
        elif d.kind == CONTENT:
            content.append(d.text)
        elif d.kind == TOOL_CALL:
            assert d.index is not None  # the emitter numbers every tool-call delta
            call = calls.setdefault(
                d.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            )
            if d.id is not None:
                call["id"] = d.id
            if d.name is not None:
                call["function"]["name"] = d.name
            call["function"]["arguments"] += d.arguments or ""
    return {
        "reasoning": "".join(reasoning),
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
