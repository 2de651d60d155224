"""Mistral's formats: ``[TOOL_CALLS]`` (a special token), then the calls, to the end of the
answer. Nemo (and Mistral 7B v0.3) write a JSON list with 9-character call ids::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]

Small 3.2, Devstral and Ministral 3 (their templates render ``[ARGS]``) write each call as its
name, optionally ``[CALL_ID]`` and an id, then ``[ARGS]`` and the arguments' JSON, one
``[TOOL_CALLS]`` per call::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

Ministral 3's reasoning variants think in ``[THINK]`` ... ``[/THINK]``. Mistral's templates
refuse a past call whose id is not 9 letters and digits: :meth:`MistralFormat.adapt` renames the
other ids (OpenAI's ``call_...``) consistently, and the calls it answers get such ids.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Mapping
from typing import Any

from ..partial_json import json_so_far, skip_ws
from ..tools import ParsedToolCall, json_calls_so_far, parse_tool_block, parse_unfinished_tool_block
from .base import Messages, Speller, ToolFormat, Tools, call_schema, chosen, json_arguments, name_of

__all__ = ["MistralArgsFormat", "MistralFormat", "TOOL_CALLS"]

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
THINK_OPEN = "[THINK]"
THINK_CLOSE = "[/THINK]"

_ALPHANUMERIC = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_NAMED_CALL = re.compile(r"\s*([^\[\]\s{]+?)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9_-]+)\s*)?\[ARGS\]", re.DOTALL)


def _mistral_id(call_id: str) -> str:
    """A 9-character id for ``call_id`` (the same for the same id)."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).digest()
    return "".join(_ALPHANUMERIC[b % len(_ALPHANUMERIC)] for b in digest[:9])


def _one_piece(piece: str) -> list[ParsedToolCall] | None:
    """One ``[TOOL_CALLS]``'s calls: a JSON list (Nemo) or ``NAME[ARGS]{...}``."""
    piece = piece.strip()
    if piece.startswith(("[", "{")):
        return parse_tool_block(piece)
    m = _NAMED_CALL.match(piece)
    if m is None:
        return None
    try:
        args, end = json.JSONDecoder().raw_decode(piece, m.end())
    except ValueError:
        return None
    if not isinstance(args, Mapping) or piece[end:].strip():
        return None
    return [ParsedToolCall(m.group(1), json.dumps(args, ensure_ascii=False), m.group(2))]


class MistralFormat(ToolFormat):
    name = "mistral"
    opens = (TOOL_CALLS,)
    close = None
    think = (THINK_OPEN, THINK_CLOSE)
    keep_special = frozenset({TOOL_CALLS, ARGS, CALL_ID, THINK_OPEN, THINK_CLOSE})

    def detect(self, source: str) -> bool:
        return TOOL_CALLS in source and ARGS not in source

    def adapt(
        self, messages: Messages, tools: list[Mapping[str, Any]] | None, template_kwargs: dict[str, Any]
    ) -> tuple[Messages, list[Mapping[str, Any]] | None, dict[str, Any]]:
        out = []
        for m in messages:
            if m.get("role") == "assistant" and m.get("tool_calls"):
                calls = [
                    {**c, "id": _mistral_id(c["id"])} if isinstance(c.get("id"), str) else c
                    for c in m["tool_calls"]
                ]
                m = {**m, "tool_calls": calls}
            elif m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
                m = {**m, "tool_call_id": _mistral_id(m["tool_call_id"])}
            out.append(m)
        return out, tools, template_kwargs

    def parse(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        for piece in body.split(TOOL_CALLS):
            if not piece.strip():
                continue
            got = _one_piece(piece)
            if got is None:
                return None
            calls += got
        return calls or None

    def parse_unfinished(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls: list[ParsedToolCall] = []
        for piece in body.split(TOOL_CALLS):
            got = _one_piece(piece)
            if got is not None:
                calls += got
                continue
            m = _NAMED_CALL.match(piece)
            if m is not None:  # cut inside the arguments
                calls.append(ParsedToolCall(m.group(1), piece[m.end() :].strip(), m.group(2)))
            else:
                calls += parse_unfinished_tool_block(piece.lstrip().removeprefix("["))
            break
        return calls

    def stream(self, opener: str, body: str, tools: Tools) -> list[ParsedToolCall]:
        calls: list[ParsedToolCall] = []
        pieces = body.split(TOOL_CALLS)
        for k, piece in enumerate(pieces):
            if not piece.strip():
                continue
            whole = _one_piece(piece) if k < len(pieces) - 1 else None
            if whole is not None:
                calls += whole
                continue
            if piece.lstrip().startswith(("[", "{")):
                # Nemo's ids follow the arguments: such a call comes whole, with its id
                return calls + json_calls_so_far(piece, wants_id=True)
            m = _NAMED_CALL.match(piece)
            if m is not None and piece[skip_ws(piece, m.end()) :].startswith("{"):
                calls.append(ParsedToolCall(m.group(1), json_so_far(piece, m.end())[0], m.group(2)))
            return calls
        return calls

    def new_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def _calls(self, tools: Tools, spell: Speller, *, lenient: bool = False) -> str:
        schema = call_schema(tools, lenient=lenient)
        for alt in schema["anyOf"]:
            alt["properties"]["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            alt["required"].append("id")
        return f'start: {spell(TOOL_CALLS)} "[" call "]"\ncall: %json {json.dumps(schema)}\n'

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        return self._calls(chosen(tools, forced), spell)


class MistralArgsFormat(MistralFormat):
    name = "mistral_args"

    def detect(self, source: str) -> bool:
        return TOOL_CALLS in source and ARGS in source

    def _named(self, tools: Tools, spell: Speller) -> str:
        rules = [
            f"call{i}: {json.dumps(name_of(t))} {spell(ARGS)} {json_arguments(t)}"
            for i, t in enumerate(tools)
        ]
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        return f"start: {spell(TOOL_CALLS)} ({calls})\n" + "\n".join(rules) + "\n"

    def call_lark(self, tools: Tools, forced: str | None, prefix: str, spell: Speller) -> str:
        return self._named(chosen(tools, forced), spell)
