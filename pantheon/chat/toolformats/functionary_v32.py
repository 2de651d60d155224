"""Functionary v3.2's format: every message opens with its recipient on a line of its own
(the generation prompt writes the first ``>>>``): ``all`` for text to the user, else the
function's name, then its arguments' JSON (code for ``python``); more messages follow after
``>>>``::

    get_weather
    {"city": "Paris"}>>>all
    Let me check.
"""

from __future__ import annotations

import json

from ..partial_json import json_so_far, skip_ws
from ..tools import ParsedToolCall, parse_unfinished_tool_block
from .base import CONTENT_LEAD, Lead, Speller, ToolFormat, Tools, chosen, json_arguments, name_of

__all__ = ["FunctionaryV32Format"]

RECIPIENT = ">>>"
_TO_USER = "all"
_MAX_NAME = 128  # a first line this long with no newline is text, not a recipient


def _one(piece: str, tools: Tools) -> ParsedToolCall | None:
    name, sep, body = piece.partition("\n")
    name = name.strip()
    if not sep or not name or name == _TO_USER:
        return None
    if name == "python" and not body.lstrip().startswith("{"):
        return ParsedToolCall(name, json.dumps({"code": body.strip()}, ensure_ascii=False))
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


class FunctionaryV32Format(ToolFormat):
    name = "functionary_v3.2"
    opens = (RECIPIENT,)
    close = None
    think = None

    def detect(self, source: str) -> bool:
        return ">>>all" in source

    def lead(self, text: str, final: bool) -> Lead | None:
        line, sep, _ = text.partition("\n")
        if not sep:
            if final or len(text) > _MAX_NAME:
                return CONTENT_LEAD
            return None
        if line.strip() == _TO_USER:
            return Lead(skip=len(line) + 1)
        return Lead(call=True)

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        calls = []
        for piece in body.split(RECIPIENT):
            call = _one(piece, tools)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls = []
        for piece in body.split(RECIPIENT):
            call = _one(piece, tools)
            if call is not None:
                calls.append(call)
                continue
            name, sep, rest = piece.partition("\n")
            if sep and name.strip() and name.strip() != _TO_USER:
                cut = parse_unfinished_tool_block(
                    '{"name": ' + json.dumps(name.strip()) + ', "arguments": ' + rest
                )
                calls += cut
            break
        return calls

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls = []
        for piece in body.split(RECIPIENT):
            name, sep, rest = piece.partition("\n")
            name = name.strip()
            if not sep or not name or name == _TO_USER or not rest.startswith("{", skip_ws(rest, 0)):
                break  # (text to the user, and python's code, go whole)
            args, end = json_so_far(rest)
            calls.append(ParsedToolCall(name, args))
            if end is None:
                break
        return calls

    def _lark(self, tools: Tools) -> str:
        rules = [
            f"call{i}: {json.dumps(name_of(t) + chr(10))} {json_arguments(t)}" for i, t in enumerate(tools)
        ]
        return "start: " + " | ".join(f"call{i}" for i in range(len(tools))) + "\n" + "\n".join(rules) + "\n"

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        # after the generation prompt's ``>>>``: the recipient, then the arguments
        return self._lark(chosen(tools, forced))
